"""Requests that cannot all fit the KV pool at once wait for pages rather than fail: a daemon whose pool holds two
requests (8 pages of 64 tokens) answers six at once, each needing 4 pages, every one 200. The finished requests'
prefix-cache checkpoints (a last one holding no page, its tail in the snapshot, above one holding the pages) give
their pages back."""

from __future__ import annotations

import threading


def test_requests_beyond_the_pool_wait_for_the_cached_pages(tiny_hf_llama, tmp_path, start_daemon):
    from flared.core.export import ExportOptions, export_core

    core = tmp_path / "small"
    export_core(tiny_hf_llama, core, ExportOptions(concurrency=2, context_tokens=256))
    daemon = start_daemon(core)
    results = []

    def ask(i: int) -> None:
        text = " ".join(f"w{i}{j}" for j in range(40))
        results.append(daemon.chat([{"role": "user", "content": text}], max_tokens=4, temperature=0))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [status for status, _ in results] == [200] * 6, [body for _, body in results]
    assert all(body["usage"]["prompt_tokens"] > 3 * 64 for _, body in results)  # (4 pages each, of 8)
