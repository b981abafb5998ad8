"""Open a prepared core: validate everything, then hand out its parts.

``open_core`` reads and validates the manifest, checks the model config and
every asset's size and SHA-256 before any weight is read or any memory is
allocated for serving. Only then do ``load_tensors`` and friends touch the
files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flared.core.manifest import Manifest, read_manifest, verify_assets
from flared.errors import CoreError, ErrorKind


@dataclasses.dataclass(frozen=True)
class Core:
    path: Path
    manifest: Manifest
    config: "ModelConfig"  # noqa: F821 - flared.model.config.ModelConfig

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest.tokenizer

    def chat_template(self) -> str | None:
        if self.manifest.chat_template is None:
            return None
        return (self.path / self.manifest.chat_template).read_text(encoding="utf-8")

    def load_tensors(self) -> dict:
        """Read every weight shard (already hash-checked by open_core) and check
        the names and shapes against the model config."""
        from safetensors.torch import load_file

        from flared.model.loader import check_serving_tensors

        tensors: dict = {}
        for name in self.manifest.weights:
            path = self.path / name
            try:
                part = load_file(str(path), device="cpu")
            except Exception as e:  # safetensors raises its own types besides OSError
                raise CoreError(f"{path}: not a readable safetensors file: {e}", ErrorKind.CORE_FORMAT) from None
            overlap = tensors.keys() & part.keys()
            if overlap:
                raise CoreError(f"{path}: tensor {sorted(overlap)[0]!r} also appears in another shard",
                                ErrorKind.CORE_FORMAT)
            tensors.update(part)
        check_serving_tensors(tensors, self.config, source=str(self.path))
        return tensors

    @property
    def vision_config(self):
        """The image tower's ``flared.model.vision.VisionConfig``; None for a text-only core."""
        from flared.model.vision import VisionConfig

        v = self.manifest.vision
        if v is None:
            return None
        try:
            return VisionConfig.from_dict(v["config"])
        except CoreError as e:
            raise CoreError(f"{self.path / 'manifest.json'}: field 'vision.config': {e}", e.kind) from None

    def image_processor(self):
        """The ``flared.frontend.images`` processor a vision core's prompts are prepared with (None: text)."""
        from flared.errors import FrontendError
        from flared.frontend.images import image_processor_from_dict

        if self.manifest.vision is None:
            return None
        try:
            return image_processor_from_dict(self.manifest.vision["processor"])
        except (FrontendError, KeyError, TypeError, ValueError) as e:
            raise CoreError(f"{self.path / 'manifest.json'}: field 'vision.processor': {e}",
                            ErrorKind.CORE_FORMAT) from None

    @property
    def audio_config(self):
        """A second tower's VisionConfig (Gemma 4's audio beside its images); None where the core has none."""
        from flared.model.vision import VisionConfig

        v = self.manifest.vision
        if v is None or "audio" not in v:
            return None
        try:
            return VisionConfig.from_dict(v["audio"]["config"])
        except CoreError as e:
            raise CoreError(f"{self.path / 'manifest.json'}: field 'vision.audio.config': {e}", e.kind) from None

    def audio_processor(self):
        """The second tower's processor (flared.frontend.audio's); None where the core has none."""
        from flared.errors import FrontendError
        from flared.frontend.images import image_processor_from_dict

        if self.manifest.vision is None or "audio" not in self.manifest.vision:
            return None
        try:
            return image_processor_from_dict(self.manifest.vision["audio"]["processor"])
        except (FrontendError, KeyError, TypeError, ValueError) as e:
            raise CoreError(f"{self.path / 'manifest.json'}: field 'vision.audio.processor': {e}",
                            ErrorKind.CORE_FORMAT) from None

    def video_processor(self):
        """The ``flared.frontend.video`` processor a video core prepares videos with (None: no video)."""
        from flared.errors import FrontendError
        from flared.frontend.video import video_processor_from_dict

        if self.manifest.vision is None or "video" not in self.manifest.vision:
            return None
        try:
            return video_processor_from_dict(self.manifest.vision["video"])
        except (FrontendError, TypeError, ValueError) as e:
            raise CoreError(f"{self.path / 'manifest.json'}: field 'vision.video': {e}",
                            ErrorKind.CORE_FORMAT) from None

    def load_vision_tensors(self) -> dict:
        """The image tower's tensors (hash-checked by open_core), names and shapes checked."""
        return self.load_tower_tensors()[0]

    def load_audio_tensors(self) -> dict:
        """A second tower's tensors (the "audio."-prefixed ones of the vision file), names and shapes checked."""
        return self.load_tower_tensors()[1]

    def load_tower_tensors(self) -> tuple[dict, dict | None]:
        """(the image tower's tensors, a second tower's or None), from one read of the vision file."""
        from safetensors.torch import load_file

        from flared.model.vision import check_vision_tensors

        path = self.path / self.manifest.vision["weights"]
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as e:  # safetensors raises its own types besides OSError
            raise CoreError(f"{path}: not a readable safetensors file: {e}", ErrorKind.CORE_FORMAT) from None
        audio = {k[len("audio."):]: tensors.pop(k) for k in [k for k in tensors if k.startswith("audio.")]}
        check_vision_tensors(tensors, self.vision_config, source=str(path))
        second = self.audio_config
        if second is not None:
            check_vision_tensors(audio, second, source=f"{path} (audio.*)")
        elif audio:
            raise CoreError(f"{path}: audio tensors without a 'vision.audio' config", ErrorKind.CORE_FORMAT)
        return tensors, (audio if second is not None else None)


def open_core(path: str | Path, *, verify_hashes: bool = True) -> Core:
    from flared.model.config import ModelConfig

    path = Path(path)
    manifest = read_manifest(path)
    try:
        config = ModelConfig.from_dict(manifest.model)
    except CoreError as e:
        raise CoreError(f"{path / 'manifest.json'}: field 'model': {e}", e.kind) from None
    core = Core(path=path, manifest=manifest, config=config)
    if manifest.vision is not None:
        vision = core.vision_config
        for tower in (vision, core.audio_config):
            if tower is not None and tower.text_hidden_size != config.hidden_size:
                raise CoreError(f"{path / 'manifest.json'}: {tower.family} rows of {tower.text_hidden_size} features "
                                f"do not fit the decoder's hidden size {config.hidden_size}", ErrorKind.CORE_FORMAT)
    if verify_hashes:
        verify_assets(path, manifest)
    return core
