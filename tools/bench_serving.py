"""Load-test any OpenAI-compatible server; the same command as `flarectl bench`.

    python tools/bench_serving.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
        --workload fixed --input-tokens 508 --output-tokens 128 --concurrency 8 --num-requests 32 --json
"""

from flared.bench.cli import bench

if __name__ == "__main__":
    bench()
