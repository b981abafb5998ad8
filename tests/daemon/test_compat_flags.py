"""vLLM's and llama.cpp's server's command lines run `flared run` unchanged: their names for the model, its aliases,
threads, capacities and the tool-call and reasoning parsers (a real daemon, the openai SDK)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_vllm_and_llamacpp_flags_serve_the_model_by_its_aliases_with_the_named_tool_parser(tiny_core, tmp_path):
    openai = pytest.importorskip("openai")
    from flared_testing.daemon import Daemon

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = Daemon(tiny_core, tmp_path)
    try:  # the tiny model's template has no tool-call format: tools are refused until a parser is named
        client = openai.OpenAI(base_url=plain.base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="tool_parser"):
            client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4)
        (card,) = client.models.list().data  # and the card says so
        assert card.capabilities["tools"] is False and card.capabilities["reasoning"] is False
    finally:
        assert plain.stop() == 0, plain.log()
    d = Daemon(tiny_core, tmp_path, "-m", str(tiny_core), "--served-model-name", "alias-one", "-a", "alias-two",
               "-t", "1", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
               "--jinja")
    try:
        client = openai.OpenAI(base_url=d.base + "/v1", api_key="unused", max_retries=0)
        # --served-model-name renames the model, as vLLM's does: the card's id; every other name still reaches it
        (card,) = client.models.list().data
        assert card.id == "alias-one"
        # the card's capabilities are what the server parses: the named parsers'
        assert card.capabilities["tools"] is True and card.capabilities["reasoning"] is True
        for name in ("alias-two", "tiny", card.root):
            assert client.models.retrieve(name).id == "alias-one"
        r = client.chat.completions.create(model="alias-two", messages=messages, tools=TOOLS, max_tokens=8,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="alias-three", messages=messages, max_tokens=2)
    finally:
        assert d.stop() == 0, d.log()


def test_vllm_parser_names_are_the_families_they_name():
    from flared.config import ConfigError, ServerConfig
    from flared.frontend.reasoning import FORMATS, HARMONY, SEED_THINK, THINK
    from flared.frontend.toolcalls import PARSERS, DeepSeekToolParser, HarmonyToolParser

    assert PARSERS["openai"] is HarmonyToolParser and PARSERS["deepseek_v3"] is DeepSeekToolParser
    assert all(FORMATS[n] is THINK for n in ("deepseek_r1", "deepseek_v3", "qwen3", "glm45", "minimax_m2"))
    assert FORMATS["gpt_oss"] is HARMONY and FORMATS["seed_oss"] is SEED_THINK
    assert ServerConfig(tool_parser="openai", reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    with pytest.raises(ConfigError, match="tool_parser"):
        ServerConfig(tool_parser="nonesuch")
    with pytest.raises(ConfigError, match="served_model_name"):
        ServerConfig(served_model_name="")


def test_conflicting_or_unknown_compat_flags_are_refused_before_loading():
    from flared.cli.daemon import main

    runner = CliRunner()
    out = runner.invoke(main, ["run", "a-core", "-m", "another", "--no-admin-socket"])
    assert out.exit_code == 2 and "name different models" in out.output
    out = runner.invoke(main, ["run", "--reasoning-format", "none", "--reasoning-parser", "think",
                               "--no-admin-socket"])
    assert out.exit_code == 2 and "--reasoning-format" in out.output
    out = runner.invoke(main, ["run", "--tool-call-parser", "nonesuch", "--no-admin-socket"])
    assert out.exit_code == 2 and "tool_parser" in out.output
    out = runner.invoke(main, ["run", "--reasoning-format", "sometimes", "--no-admin-socket"])
    assert out.exit_code == 2 and "sometimes" in out.output


def test_llamacpp_capacity_names():
    from flared.cli.ctl import capacity_options

    @click.command()
    @capacity_options
    def show(context, concurrency, kv_cache_mib, prefill_chunk):
        click.echo(f"{context} {concurrency} {kv_cache_mib} {prefill_chunk}")

    out = CliRunner().invoke(show, ["-c", "512", "-np", "4", "-ub", "256"])
    assert out.exit_code == 0 and out.output.split() == ["512", "4", "None", "256"]
    out = CliRunner().invoke(show, ["--ctx-size", "1024", "--parallel", "8", "--max-model-len", "2048",
                                    "--ubatch-size", "128", "--max-num-batched-tokens", "1024"])
    assert out.exit_code == 0 and out.output.split() == ["2048", "8", "None", "1024"]
