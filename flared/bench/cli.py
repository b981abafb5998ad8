"""`flarectl bench` / tools/bench_serving.py: the click command over `run_bench`."""

from __future__ import annotations

import json
import sys

import click

from flared.bench.run import BenchConfig, run_bench
from flared.bench.workload import WorkloadKind, WorkloadSpec, build_sessions


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


@click.command("bench")
@click.option("--url", "base_url", default="http://127.0.0.1:8000", show_default=True,
              help="Server base URL (an OpenAI-compatible /v1/chat/completions is used).")
@click.option("--model", required=True, help="Model name to send.")
@click.option("--workload", type=click.Choice([k.value for k in WorkloadKind]), default="random", show_default=True)
@click.option("--num-requests", type=int, default=64, show_default=True, help="Most turns to send.")
@click.option("--duration-s", type=float, default=300.0, show_default=True, help="No request starts after this.")
@click.option("--concurrency", type=int, default=1, show_default=True, help="Sessions in flight (fixed mode).")
@click.option("--request-rate", type=float, default=None, help="Poisson sessions per second (instead of --concurrency).")
@click.option("--input-tokens", type=int, default=256, show_default=True, help="fixed ISL; multi-turn first turn.")
@click.option("--output-tokens", type=int, default=128, show_default=True, help="fixed/multi-turn OSL.")
@click.option("--input-range", nargs=2, type=int, default=(16, 512), show_default=True, help="random ISL range.")
@click.option("--output-range", nargs=2, type=int, default=(16, 256), show_default=True, help="random OSL range.")
@click.option("--turns", type=int, default=4, show_default=True, help="multi-turn: turns per conversation.")
@click.option("--turn-input-tokens", type=int, default=64, show_default=True, help="multi-turn: later turns' user text.")
@click.option("--length-scale", type=float, default=1.0, show_default=True, help="sharegpt: scale both lengths.")
@click.option("--tokenizer", default=None, help="tokenizer.json to cut prompts to exact token counts.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--api-key", default=None, help="Bearer token.")
@click.option("--request-timeout-s", type=float, default=600.0, show_default=True)
@click.option("--no-ignore-eos", is_flag=True, help="Do not send ignore_eos (outputs may end early).")
@click.option("--ban-token", "banned", type=int, multiple=True, help="Token id biased -100 (EOS for servers "
              "without ignore_eos); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
def bench(base_url, model, workload, num_requests, duration_s, concurrency, request_rate, input_tokens,
          output_tokens, input_range, output_range, turns, turn_input_tokens, length_scale, tokenizer, seed,
          api_key, request_timeout_s, no_ignore_eos, banned, as_json, no_progress):
    """Load-test an OpenAI-compatible server and report throughput and latency."""
    kind = WorkloadKind(workload)
    num_sessions = num_requests if kind is not WorkloadKind.MULTI_TURN else -(-num_requests // turns)
    try:
        spec = WorkloadSpec(kind=kind, num_sessions=num_sessions, seed=seed, input_tokens=input_tokens,
                            output_tokens=output_tokens, input_tokens_min=input_range[0],
                            input_tokens_max=input_range[1], output_tokens_min=output_range[0],
                            output_tokens_max=output_range[1], turns=turns, turn_input_tokens=turn_input_tokens,
                            length_scale=length_scale)
        config = BenchConfig(base_url=base_url, model=model, concurrency=concurrency, request_rate=request_rate,
                             max_requests=num_requests, duration_s=duration_s, request_timeout_s=request_timeout_s,
                             api_key=api_key, ignore_eos=not no_ignore_eos, banned_token_ids=tuple(banned),
                             seed=seed, progress=not no_progress and sys.stderr.isatty())
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    result = run_bench(config, build_sessions(spec, _load_tokenizer(tokenizer)))
    click.echo(f"workload {workload}, {base_url}, model {model}")
    click.echo(result.table())
    if as_json:
        click.echo(json.dumps({"workload": workload, **result.to_json()}))
    if result.num_ok == 0:
        sys.exit(1)
