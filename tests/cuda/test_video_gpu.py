"""Videos on the CUDA graph executor: a Qwen2.5-VL and a Qwen3-VL core take vLLM's video_url parts without
--enforce-eager, the tower running each video's frame pairs between steps and the prefill that feeds its tokens
running eagerly with the rows in place. float32: the greedy tokens are the same core's under --enforce-eager
(tests/api/test_video_qwen.py holds those to transformers'); bf16 (as the CUDA backend serves): the same first
token, its alternatives' log-probabilities within bf16's drift on these random weights (0.2 init range). Skipped
without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("av")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_qwen_vl_core_takes_videos_on_the_cuda_graphs(tiny_qwen_vl, dtype, tmp_path, start_daemon):
    import shutil

    from flared_testing.video import noise_video, video_part

    from flared.core.export import ExportOptions, export_core

    family, source, _ = tiny_qwen_vl
    if family not in ("qwen2_5_vl", "qwen3_vl"):
        pytest.skip(f"{family}: Qwen2.5-VL's temporal positions and Qwen3-VL's frame blocks cover the graphs")
    checkpoint = tmp_path / "hf"
    shutil.copytree(source, checkpoint)
    config = ({"size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 60 * 32 * 32}} if family == "qwen3_vl"
              else {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 25 * 28 * 28}})
    (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(config))
    core = tmp_path / "core"
    export_core(checkpoint, core, ExportOptions(dtype=dtype, concurrency=4, context_tokens=1024,
                                                prefill_chunk_tokens=128))
    clip = video_part(noise_video(25, (96, 64), 10, seed=3))
    answers = []
    for args in ((), ("--enforce-eager",)):
        d = start_daemon(core, *args)
        status, body = d.chat([{"role": "user", "content": "What?"}], max_tokens=4)
        assert status == 200, body
        text_tokens = body["usage"]["prompt_tokens"]
        status, body = d.chat([{"role": "user", "content": [clip, {"type": "text", "text": "What happens?"}]}],
                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True,
                              return_tokens_as_token_ids=True)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > text_tokens + 10  # the video's tokens
        answers.append(body["choices"][0]["logprobs"]["content"])
        assert ("executor: eager on" in d.log()) == bool(args)
        d.kill()
    graphs, eager = answers
    if dtype == "float32":
        assert [t["token"] for t in graphs] == [t["token"] for t in eager]
        return
    assert graphs[0]["token"] == eager[0]["token"]
    first = [{t["token"]: t["logprob"] for t in steps[0]["top_logprobs"]} for steps in (graphs, eager)]
    shared = set(first[0]) & set(first[1])
    assert max(abs(first[0][t] - first[1][t]) for t in shared) < 0.35, first
