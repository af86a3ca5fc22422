"""NOTE [program cache] (kimi_cg/program_cache.py): Inductor-compiled device programs stored on disk
and loaded by a later process, only where the stored compile's size assumptions hold."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import sympy
import torch

import kimi_cg
from kimi_cg import program_cache
from kimi_cg.device_program import ShapeAssumptions
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel

GRIDS = ([[8, 8]], [[4, 6], [10, 4]], [[6, 6], [2, 2], [4, 8]])

# One process of a serving fleet: the tiny tower with Inductor device programs on a few grids; writes
# its outputs and kimi_cg's counters.
PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, kimi_cg
    from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel

    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"device_compiler": "inductor", "strict": True})
    pixels = torch.randn(400, 3, 14, 14)
    outputs, worst = [], 0.0
    with torch.no_grad():
        for grid in json.loads(sys.argv[2]):
            grid = torch.tensor(grid)
            rows = int(grid.prod(-1).sum())
            got, want = compiled(pixels[:rows], grid), model(pixels[:rows], grid)
            outputs.extend(got)
            for g, w in zip(got, want):
                assert not torch.isnan(g).any()
                worst = max(worst, float((g - w).abs().max() / w.abs().max()))
    torch.save(outputs, sys.argv[1] + ".pt")
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump({"counters": dict(kimi_cg.counters), "worst": worst}, f)
    """
)


def _run_process(tmp_path, name: str, cache: str) -> tuple[dict, list]:
    out = str(tmp_path / name)
    environment = dict(os.environ, KIMI_CG_PROGRAM_CACHE=cache)
    result = subprocess.run([sys.executable, "-P", "-c", PROCESS_SCRIPT, out, json.dumps(GRIDS)], capture_output=True,
                            text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out + ".json") as f:
        report = json.load(f)
    return report, torch.load(out + ".pt")


def test_a_second_process_loads_the_program_the_first_stored(tmp_path):
    cache = str(tmp_path / "programs")
    first, first_outputs = _run_process(tmp_path, "first", cache)
    second, second_outputs = _run_process(tmp_path, "second", cache)
    assert first["counters"].get("program_cache_stores") == 1, first["counters"]
    assert first["counters"].get("program_cache_hits", 0) == 0, first["counters"]
    assert second["counters"].get("program_cache_hits") == 1, second["counters"]
    assert second["counters"].get("program_cache_stores", 0) == 0, second["counters"]
    for report in (first, second):
        assert report["counters"].get("program_cache_errors", 0) == 0, report["counters"]
        assert report["counters"].get("call_fallbacks", 0) == 0, report["counters"]
        assert report["worst"] <= 1e-5, report
    # The same compiled code: the same bits.
    assert len(first_outputs) == len(second_outputs) > 0
    assert all(torch.equal(a, b) for a, b in zip(first_outputs, second_outputs))
    assert len(glob.glob(os.path.join(cache, "*", "*.bin"))) == 1


def _tower():
    torch.manual_seed(0)
    return MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()


def _run(model, grids=GRIDS):
    """A fresh compile of ``model`` (as in a new process: no device program in memory) on ``grids``;
    the worst relative error against eager."""
    torch._dynamo.reset()
    kimi_cg.reset()  # after dynamo's reset, which drops the compile callbacks kimi_cg installs
    compiled = torch.compile(model, backend="kimi_cg", options={"device_compiler": "inductor", "strict": True})
    pixels = torch.randn(400, 3, 14, 14, generator=torch.Generator().manual_seed(1))
    worst = 0.0
    for grid in grids:
        grid = torch.tensor(grid)
        rows = int(grid.prod(-1).sum())
        for got, want in zip(compiled(pixels[:rows], grid), model(pixels[:rows], grid)):
            assert not torch.isnan(got).any()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def _records(cache):
    return sorted(glob.glob(os.path.join(cache, "*", "*.json")))


def test_an_entry_serves_only_calls_its_assumptions_hold_for(tmp_path, monkeypatch):
    cache = str(tmp_path / "programs")
    monkeypatch.setenv(program_cache.ENVIRONMENT_VARIABLE, cache)
    model = _tower()
    assert _run(model) <= 1e-5
    assert kimi_cg.counters["program_cache_stores"] == 1
    # An entry compiled under a condition no call meets (as a compile at other sizes could be): passed
    # over, the program compiles, and the new compile is a second entry.
    (path,) = _records(cache)
    with open(path) as f:
        record = json.load(f)
    symbol = program_cache.expression_from_text(record["assumptions"]["order"][0])
    record["assumptions"]["conditions"].append(program_cache.expression_to_text(sympy.Eq(symbol, 100003)))
    with open(path, "w") as f:
        json.dump(record, f)
    assert _run(model) <= 1e-5
    assert kimi_cg.counters["program_cache_hits"] == 0 and kimi_cg.counters["program_cache_stores"] == 1
    assert len(_records(cache)) == 2
    assert _run(model) <= 1e-5  # the new entry serves
    assert kimi_cg.counters["program_cache_hits"] == 1 and kimi_cg.counters["program_cache_stores"] == 0


def test_an_entry_that_does_not_load_is_passed_over(tmp_path, monkeypatch):
    cache = str(tmp_path / "programs")
    monkeypatch.setenv(program_cache.ENVIRONMENT_VARIABLE, cache)
    model = _tower()
    assert _run(model, GRIDS[:2]) <= 1e-5
    (artifact,) = glob.glob(os.path.join(cache, "*", "*.bin"))
    with open(artifact, "r+b") as f:
        f.truncate(os.path.getsize(artifact) // 2)
    assert _run(model, GRIDS[:2]) <= 1e-5
    assert kimi_cg.counters["program_cache_errors"] == 1, dict(kimi_cg.counters)
    assert kimi_cg.counters["program_cache_hits"] == 0 and kimi_cg.counters["program_cache_stores"] == 1
    assert kimi_cg.counters["call_fallbacks"] == 0


@pytest.mark.parametrize("value", ["0", "off", "OFF", " false ", "no"])
def test_the_cache_is_off_when_the_environment_says_so(tmp_path, monkeypatch, value):
    monkeypatch.setenv(program_cache.ENVIRONMENT_VARIABLE, value)
    monkeypatch.chdir(tmp_path)
    assert program_cache.directory() is None
    assert _run(_tower(), GRIDS[:1]) <= 1e-5
    assert not any(k.startswith("program_cache") for k in kimi_cg.counters), dict(kimi_cg.counters)
    assert not any(tmp_path.iterdir())


def test_the_cache_is_on_by_default_under_inductors_cache_directory(tmp_path, monkeypatch):
    """Unset or empty: the cache sits under Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR), and a
    compile stores its program there."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv(program_cache.ENVIRONMENT_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(program_cache.ENVIRONMENT_VARIABLE, value)
        assert program_cache.directory() == str(tmp_path / "inductor" / "kimi_cg_programs")
    # (two calls: the first builds the RoPE table on the plain program, NOTE [a graph that builds module state])
    assert _run(_tower(), GRIDS[:2]) <= 1e-5
    assert kimi_cg.counters["program_cache_stores"] == 1, dict(kimi_cg.counters)
    assert any(path.suffix == ".json" for path in (tmp_path / "inductor" / "kimi_cg_programs").rglob("*"))


def test_the_cache_is_off_where_inductor_may_fold_weights_into_the_program(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setenv(program_cache.ENVIRONMENT_VARIABLE, "/nonexistent/programs")
    assert program_cache.directory() == "/nonexistent/programs"
    with inductor_config.patch(freezing=True):
        assert program_cache.directory() is None


def test_size_assumptions_read_back_identical():
    """Guards with torch's size functions (FloorDiv, Mod) and replacements survive srepr text."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    fake_mode = FakeTensorMode(shape_env=shape_env)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    x = fake_mode.from_tensor(torch.empty(12, 6), symbolic_context=context)
    y = fake_mode.from_tensor(torch.empty(6, 6), symbolic_context=context)
    # Before the ops, as kimi_cg reads them: a symbol's expression reads through later replacements.
    symbols = {x.shape[0].node.expr: (0, 0), x.shape[1].node.expr: (0, 1), y.shape[0].node.expr: (1, 0),
               y.shape[1].node.expr: (1, 1)}
    with fake_mode:
        x.view(x.shape[0] // 4, 4, -1)  # Mod(s0, 4) == 0
        torch.cat([x, y]).view(-1, 3, x.shape[1])  # widths equal (a replacement), a guard over a sum
        x.T @ x
    assumptions = ShapeAssumptions(shape_env, symbols)
    assert assumptions.conditions, "the ops above guard"
    record = assumptions.to_record()
    again = ShapeAssumptions.from_record(json.loads(json.dumps(record)))
    assert again.to_record() == record
    positions = [(0, 0), (0, 1), (1, 0), (1, 1)]
    for signature in [(12, 6, 6, 6), (16, 6, 5, 6), (10, 6, 6, 6), (8, 3, 1, 3), (12, 6, 6, 7)]:
        assert again.hold(positions, signature) == assumptions.hold(positions, signature), signature
    assert assumptions.hold(positions, (12, 6, 6, 6)) and not assumptions.hold(positions, (10, 6, 6, 6))


def test_the_key_follows_what_decides_the_compile():
    weight = torch.nn.Parameter(torch.randn(8, 4))
    rows = torch.randn(10, 4)
    key = program_cache.entry_key("program", [rows, weight], frozenset())
    assert program_cache.entry_key("program", [torch.randn(37, 4), weight], frozenset()) == key  # rows are symbolic
    assert program_cache.entry_key("program", [rows, torch.nn.Parameter(torch.randn(8, 5))], frozenset()) != key
    assert program_cache.entry_key("program", [rows.double(), weight], frozenset()) != key
    assert program_cache.entry_key("program", [torch.randn(4, 10).T, weight], frozenset()) != key  # stride order
    assert program_cache.entry_key("other program", [rows, weight], frozenset()) != key
    assert program_cache.entry_key("program", [rows, weight], frozenset({0})) != key


def test_large_constants_key_the_stored_program_by_content():
    from kimi_cg.device_program import structural_hash

    def program(constant):
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        gm.register_buffer("table", constant)
        x = gm.graph.placeholder("x")
        gm.graph.output(gm.graph.call_function(torch.add, (x, gm.graph.get_attr("table"))))
        gm.recompile()
        return gm

    big = torch.zeros((1 << 20) + 1)
    other = big.clone()
    other[-1] = 1.0
    assert structural_hash(program(big), constants_by_content=True) != structural_hash(program(other), constants_by_content=True)
    assert structural_hash(program(big), constants_by_content=True) == structural_hash(program(big.clone()),
                                                                                       constants_by_content=True)


def test_warmup_bench_runs_cold_then_warm_on_cpu(tmp_path):
    out = tmp_path / "warmup.json"
    result = subprocess.run([sys.executable, "-P", "scripts/warmup_bench.py", "--family", "moonvit", "--smoke-test-on-cpu",
                             "--max-items", "2", "--cache-dir", str(tmp_path / "programs"), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    cold, warm = report["processes"]
    assert cold["counters"].get("program_cache_stores") == 1 and warm["counters"].get("program_cache_hits") == 1
    assert warm["counters"].get("device_programs_compiled") == 1  # built from the graph, its compile loaded
    assert (cold["warm_up"]["programs_stored"], warm["warm_up"]["programs_loaded"]) == (1, 1)
    for run in (cold, warm):
        assert run["warm_up"]["calls"] == 3 and run["counters"].get("call_fallbacks", 0) == 0
