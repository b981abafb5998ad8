"""Videos on the CUDA graph executor, Qwen2.5-VL (a video's temporal patches at tokens_per_second x
second_per_grid_t), Qwen3-VL (each frame pair its own block, timestamps between) and Gemma 4 (each frame through
the tower alone; 26B-like frames both ways on the windowed layers): the tower runs the video's frames between
steps, and the prefill that feeds its tokens runs eagerly with the rows in place.

float32, the executors themselves: greedy tokens on the graphs equal the eager executor's (which
tests/api/test_video_qwen.py holds to transformers'), and the video's rows reach the logits. bf16, as a user serves
it: a daemon without --enforce-eager answers a video_url part with the first token of the same core under
--enforce-eager, its alternatives' log-probabilities within bf16's drift on these random weights (0.2 init range).
Skipped without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import collections
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("av")
sys.path.insert(0, str(Path(__file__).parent))

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
VIDEO_CONFIGS = {"qwen3_vl": {"size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 60 * 32 * 32}},
                 "qwen2_5_vl": {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 25 * 28 * 28}}}


def _core(tiny_qwen_vl, tmp_path, dtype: str) -> tuple[str, Path]:
    from flared.core.export import ExportOptions, export_core

    family, source, _ = tiny_qwen_vl
    if family not in FAMILIES:
        pytest.skip(f"{family}: Qwen2.5-VL's temporal positions and Qwen3-VL's frame blocks cover the graphs")
    checkpoint = tmp_path / "hf"
    shutil.copytree(source, checkpoint)
    (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIGS[family]))
    if family == "qwen2_5_vl":  # (the released models' 2: intervals of 2.5 truncated)
        config = json.loads((checkpoint / "config.json").read_text())
        config["vision_config"]["tokens_per_second"] = 2
        (checkpoint / "config.json").write_text(json.dumps(config))
    core = tmp_path / f"core-{dtype}"
    export_core(checkpoint, core, ExportOptions(dtype=dtype, concurrency=4, context_tokens=512,
                                                prefill_chunk_tokens=128))
    return family, core


def _video_requests(core_path, model):
    """Text, a video, text; text alone; text, a video, text again: the video's rows made by VisionJob, its
    positions and 3D rope laid out as the server lays them (its tokens, Qwen3-VL's frame markers)."""
    from flared_testing.video import noise_video

    from flared.core.load import open_core
    from flared.model.vision import mrope_positions
    from flared.runtime.request import VisionInput
    from flared.runtime.worker import VisionJob

    core = open_core(core_path)
    config = core.manifest.vision["config"]
    video = core.video_processor().prepare(noise_video(25, (96, 64), 10, seed=3))
    job = VisionJob([video], done=None)
    while not job.step(model, 0, collections.Counter()):
        pass
    rows = job.result()[0]
    token, merge = int(config["video_token_id"]), int(config["scale_factor"])
    t, h, w = video.grid
    per = h * w // merge ** 2

    def request(before, after):
        ids, blocks = list(before), []
        if video.frames_apart:  # (Qwen3-VL: "<t seconds>", then each frame pair in vision markers)
            for k in range(t):
                ids += [30 + k, 31, 32]
                blocks.append((len(ids), per, (1, h, w)))
                ids += [token] * per + [33]
        else:
            interval = float(np.float32(video.seconds_per_grid)) * float(config["tokens_per_second"])
            blocks.append((len(ids), t * per, video.grid, interval))
            ids += [token] * (t * per)
        ids += list(after)
        mrope, delta = mrope_positions(ids, blocks, merge)
        positions = np.flatnonzero(np.asarray(ids) == token)
        return ids, VisionInput(positions, rows, (), mrope, delta)

    cases = [request(range(20, 100), range(40, 52)), (list(range(60, 90)), None), request(range(5, 12), [70])]
    return [ids for ids, _ in cases], [v for _, v in cases]


def test_float32_graph_tokens_with_videos_equal_the_eager_executors(tiny_qwen_vl, tmp_path):
    from test_vision_gpu import _drive, _served

    family, core = _core(tiny_qwen_vl, tmp_path, "float32")
    _, model = _served(core, torch.float32)
    prompts, visions = _video_requests(core, model)
    graphs, logits = _drive(model, prompts, visions, graphs=True)
    eager, _ = _drive(model, prompts, visions, graphs=False)
    assert graphs == eager, family
    blind, blind_logits = _drive(model, prompts, [None] * len(prompts), graphs=True)
    assert blind[1] == graphs[1]  # (the text-only request)
    assert (logits - blind_logits).abs().max().item() > 1e-2  # the video's rows reach the logits


def test_a_bf16_qwen_vl_core_takes_videos_on_the_cuda_graphs(tiny_qwen_vl, tmp_path, start_daemon):
    from flared_testing.video import noise_video

    _, core = _core(tiny_qwen_vl, tmp_path, "bfloat16")
    _assert_graphs_answer_as_eager(core, start_daemon, noise_video(25, (96, 64), 10, seed=3), more_than=10)


def _assert_graphs_answer_as_eager(core, start_daemon, video: bytes, *, more_than: int) -> None:
    """A daemon of ``core`` on the CUDA graphs and one under --enforce-eager answer a video_url part with the same
    first token, its alternatives' log-probabilities within bf16's drift on these random weights (0.35); the
    prompt holds more than ``more_than`` tokens beyond a text turn's (the video's)."""
    from flared_testing.video import video_part

    answers = []
    for args in ((), ("--enforce-eager",)):
        d = start_daemon(core, *args)
        status, body = d.chat([{"role": "user", "content": "What?"}], max_tokens=4)
        assert status == 200, body
        text_tokens = body["usage"]["prompt_tokens"]
        status, body = d.chat([{"role": "user", "content": [video_part(video), {"type": "text",
                                                                                "text": "What happens?"}]}],
                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > text_tokens + more_than  # the video's tokens
        answers.append(body["choices"][0]["logprobs"]["content"])
        assert ("executor: eager on" in d.log()) == bool(args)
        d.kill()
    graphs, eager = answers
    assert graphs[0]["token"] == eager[0]["token"]
    first = [{t["token"]: t["logprob"] for t in steps[0]["top_logprobs"]} for steps in (graphs, eager)]
    shared = set(first[0]) & set(first[1])
    assert max(abs(first[0][t] - first[1][t]) for t in shared) < 0.35, first


@pytest.mark.parametrize("fixture", ["tiny_gemma4_vision", "tiny_gemma4_vision_both_ways"])
def test_a_bf16_gemma4_core_takes_videos_on_the_cuda_graphs(fixture, request, tmp_path, start_daemon):
    """Gemma 4's frames through its tower, their rows in an eager prefill of the graphs' forward (26B-like: each
    frame both ways on the windowed layers, ImageBlocks), against --enforce-eager."""
    from flared_testing.video import noise_video

    from flared.core.export import ExportOptions, export_core

    core = tmp_path / "core"
    export_core(request.getfixturevalue(fixture)[0], core, ExportOptions(dtype="bfloat16", concurrency=4,
                                                                         context_tokens=1024,
                                                                         prefill_chunk_tokens=128))
    _assert_graphs_answer_as_eager(core, start_daemon, noise_video(25, (64, 48), 10, seed=3),
                                   more_than=4 * 63)  # (4 frames of 63 tokens)
