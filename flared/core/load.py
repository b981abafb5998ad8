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


def open_core(path: str | Path, *, verify_hashes: bool = True) -> Core:
    from flared.model.config import ModelConfig

    path = Path(path)
    manifest = read_manifest(path)
    try:
        config = ModelConfig.from_dict(manifest.model)
    except CoreError as e:
        raise CoreError(f"{path / 'manifest.json'}: field 'model': {e}", e.kind) from None
    if verify_hashes:
        verify_assets(path, manifest)
    return Core(path=path, manifest=manifest, config=config)
