"""Runs on every host: the repack rule for AMX hosts, the CPU backend's feature query, and the overrides.

The rule is tested for every kind of host as a pure function; the real checks ask this host's llama.cpp build.
A test that would crash on an AMX host (loading with repacking forced on) runs only where the rule says
repacking is safe, and says so when it skips.
"""

import re

import pytest
from click.testing import CliRunner

from fsd_local.cli import cli
from fsd_local.llama.cpu_features import (
    backend_cpu_features,
    decide_repack,
    host_cpu_flags,
    host_has_amx,
    repack_choice,
)
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.settings import Settings

AMX_BUILD = {"AVX2": "1", "AVX512": "1", "AMX_INT8": "1", "REPACK": "1"}
PLAIN_BUILD = {"AVX2": "1", "AVX512": "1", "REPACK": "1"}


def test_amx_backend_on_an_amx_cpu_turns_repacking_off():
    c = decide_repack(AMX_BUILD, host_amx=True)
    assert c.repack is False and "AMX_INT8" in c.reason and "--repack" in c.reason


def test_amx_backend_where_the_os_does_not_say_is_treated_as_amx():
    assert decide_repack(AMX_BUILD, host_amx=None).repack is False


def test_amx_backend_on_a_cpu_without_amx_keeps_repacking():
    # e.g. a GGML_BACKEND_DL build whose AMX variant is present but a VM hides AMX from the guest
    c = decide_repack(AMX_BUILD, host_amx=False)
    assert c.repack is True and "lacks AMX" in c.reason


@pytest.mark.parametrize("host_amx", [True, False, None])
def test_a_backend_without_amx_kernels_always_repacks(host_amx):
    c = decide_repack(PLAIN_BUILD, host_amx=host_amx)
    assert c.repack is True and "no AMX kernels" in c.reason
    assert decide_repack({}, host_amx=host_amx).repack is True  # a build that reports no features
    assert decide_repack({**PLAIN_BUILD, "AMX_INT8": "0"}, host_amx=host_amx).repack is True


@pytest.mark.parametrize("requested", [True, False])
@pytest.mark.parametrize("features,host_amx", [(AMX_BUILD, True), (PLAIN_BUILD, False), (AMX_BUILD, None)])
def test_an_explicit_request_wins(requested, features, host_amx):
    c = decide_repack(features, host_amx, requested)
    assert c.repack is requested and ("--repack given" if requested else "--no-repack given") == c.reason


def test_host_flags_are_read_from_cpuinfo(tmp_path):
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n")
    epyc = tmp_path / "epyc"
    epyc.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert host_has_amx(host_cpu_flags(str(amx))) is True
    assert host_has_amx(host_cpu_flags(str(epyc))) is False
    assert host_cpu_flags(str(tmp_path / "missing")) is None


def test_the_backend_reports_the_features_llama_cpp_prints():
    feats = backend_cpu_features()
    assert feats, "the CPU backend's feature query returned nothing"
    import llama_cpp as lc

    info = lc.llama_print_system_info().decode()
    printed = dict(re.findall(r"(\w+) = (\w+)", info.split("|", 1)[0] + "|" + info))
    for name, value in feats.items():
        if name in printed:
            assert printed[name] == value, name


def test_this_hosts_choice_is_consistent_with_its_cpu():
    c = repack_choice()
    if host_has_amx() and "AMX_INT8" in backend_cpu_features():
        assert c.repack is False
    print(f"\nthis host: backend {sorted(backend_cpu_features())}, CPU AMX {host_has_amx()}, repack {c}")


def test_a_model_loads_with_the_hosts_choice_and_generates(tiny_pair):
    from fsd_local import Engine

    draft, target = tiny_pair
    with Engine(target=target, draft=draft, n_ctx=256, n_threads=1) as eng:
        assert eng.target.repack == repack_choice() and eng.draft.repack == repack_choice()
        out = eng.generate("abc", mode="sd", max_tokens=20)  # batched verification: where AMX used to crash
        assert len(out.token_ids) == 20


def test_no_repack_is_honoured(tiny_pair):
    m = Model(ModelOptions(tiny_pair[1], n_ctx=128, n_threads=1, repack=False))
    try:
        assert m.repack.repack is False and m.repack.reason == "--no-repack given"
        toks = m.tokenize("abcabc")
        m.decode(toks, "from:0")
        assert m.logits().shape[0] == len(toks)
    finally:
        m.close()


def test_repack_forced_on_works_where_it_is_safe(tiny_pair):
    if not repack_choice().repack:
        pytest.skip(f"this host's default is off ({repack_choice().reason}); forcing it on would crash here")
    m = Model(ModelOptions(tiny_pair[1], n_ctx=128, n_threads=1, repack=True))
    try:
        assert m.repack.repack is True
        m.decode(m.tokenize("abcabc"), "from:0")
    finally:
        m.close()


def test_cli_flags_reach_each_model(tiny_pair):
    from fsd_local.cli.options import load_engine

    draft, target = tiny_pair
    base = dict(
        target=target,
        draft=draft,
        pair=None,
        n_ctx=128,
        n_threads=1,
        n_gpu_layers=0,
        draft_n_gpu_layers=0,
        settings=Settings(),
    )
    with load_engine(**base, repack=False) as eng:
        assert (eng.target.repack.reason, eng.draft.repack.reason) == ("--no-repack given",) * 2
    with load_engine(**base, draft_repack=False) as eng:
        assert eng.target.repack == repack_choice() and eng.draft.repack.reason == "--no-repack given"
    help_text = CliRunner().invoke(cli, ["generate", "--help"]).output
    assert "--repack / --no-repack" in help_text and "--draft-repack / --draft-no-repack" in help_text


def test_doctor_says_what_it_found_and_chose():
    import json

    r = json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).output)
    choice = repack_choice()
    assert r["cpu"]["repack"] is choice.repack and r["cpu"]["repack_reason"] == choice.reason
    assert r["cpu"]["host_amx"] is host_has_amx()
    text = CliRunner().invoke(cli, ["doctor"]).output
    assert f"repack:      {'on' if choice.repack else 'off'} by default: {choice.reason}" in text
    assert "this CPU has AMX:" in text
