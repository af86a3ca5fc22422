"""Backend options are checked when the config is built: a bad value is a ValueError that names the
option, the value and what is expected, never a TypeError or a huge allocation at the first call."""

import pathlib

import pytest
import torch

import kimi_cg
from kimi_cg.config import MAX_BUCKET_TOKENS, KimiCGConfig
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel

BAD_OPTIONS = [
    ("max_items", True),  # bool is an int to Python
    ("max_items", 0),
    ("max_items", 4097),
    ("max_items", 8.0),
    ("max_frames", 65),
    ("max_frames", False),
    ("exact_size_graphs", -1),
    ("exact_size_graphs", 1025),
    ("exact_size_graphs", True),
    ("batch_cache_size", -1),
    ("batch_cache_size", "8"),
    ("batch_cache_size", 10**6),
    ("metadata_cache_bytes", -1),
    ("metadata_cache_bytes", 1 << 50),
    ("metadata_cache_bytes", 1e9),
    ("linear_gelu_epilogue", 1),
    ("linear_gelu_epilogue", "yes"),
    ("table_gathers", 1),
    ("host_block", 1),
    ("cuda_graphs", "no"),
    ("cuda_graphs", 0),
    ("token_budgets", 4096),
    ("token_budgets", "4096"),
    ("token_budgets", []),
    ("token_budgets", [10**9]),
    ("token_budgets", [MAX_BUCKET_TOKENS + 1]),
    ("token_budgets", [1024, True]),
    ("token_budgets", [1024, 2048.0]),
    ("token_budgets", {1024, 2048}),
    ("token_budgets", [0]),
    ("min_tokens", 0),
    ("min_tokens", 10**9),
    ("max_tokens", 10**9),
    ("max_tokens", "16384"),
    ("buckets_per_doubling", 0),
    ("buckets_per_doubling", 10**9),
    ("device_compiler", "tvm"),
    ("device_compiler", None),
    ("debug_dir", 1),
    ("debug_dir", b"/tmp/kimi_cg_debug"),
    ("poison_graph_pool", "yes"),
    ("poison_graph_pool", None),
    ("strict", 1),
    ("strict", "False"),
    ("inductor_config", {"max_autotun": True}),  # a typo: not a setting
    ("inductor_config", {"max_autotune": [True]}),
    ("inductor_config", {1: True}),
    ("inductor_config", "max_autotune"),
    ("inductor_config", [("max_autotune", True), "x"]),
]


@pytest.mark.parametrize("name, value", BAD_OPTIONS, ids=[f"{name}={value!r}" for name, value in BAD_OPTIONS])
def test_bad_option_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=name) as raised:
        KimiCGConfig.from_options({name: value})
    assert repr(value)[:40] in str(raised.value)  # the value given, as the user wrote it
    assert "expected" in str(raised.value)
    with pytest.raises(ValueError, match=name):
        kimi_cg.validate_options({name: value})


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        KimiCGConfig.from_options({"min_tokens": 4096, "max_tokens": 1024})


def test_unknown_and_non_mapping_options_are_rejected():
    with pytest.raises(ValueError, match="max_item"):
        KimiCGConfig.from_options({"max_item": 4})
    with pytest.raises(ValueError, match="options"):
        KimiCGConfig.from_options([("max_items", 4)])


def test_valid_options_keep_their_meaning():
    assert KimiCGConfig.from_options(None) == KimiCGConfig()
    assert KimiCGConfig.from_options({}).buckets() == KimiCGConfig().buckets()
    assert KimiCGConfig().buckets()[0] == 1024 and KimiCGConfig().buckets()[-1] == 16384
    config = kimi_cg.validate_options({"token_budgets": [2048, 256, 2048], "max_items": 4, "cuda_graphs": False,
                                       "batch_cache_size": 0, "strict": True, "poison_graph_pool": True})
    assert isinstance(config, KimiCGConfig)
    assert config.token_budgets == (256, 2048) and config.buckets() == (256, 2048)
    assert (config.max_items, config.cuda_graphs, config.batch_cache_size, config.strict) == (4, False, 0, True)
    largest = KimiCGConfig(token_budgets=(MAX_BUCKET_TOKENS,), min_tokens=MAX_BUCKET_TOKENS, max_tokens=MAX_BUCKET_TOKENS)
    assert largest.buckets() == (MAX_BUCKET_TOKENS,)
    assert KimiCGConfig(max_items=4096, max_frames=64, buckets_per_doubling=64, metadata_cache_bytes=0).max_frames == 64


def test_debug_dir_accepts_a_path_and_stores_its_str(tmp_path):
    config = KimiCGConfig.from_options({"debug_dir": tmp_path})
    assert config.debug_dir == str(tmp_path) and isinstance(config.debug_dir, str)
    assert config.compute_hash() == KimiCGConfig(debug_dir=str(tmp_path)).compute_hash()
    assert KimiCGConfig.from_options({"debug_dir": pathlib.PurePosixPath("/tmp/x")}).debug_dir == "/tmp/x"


def test_bad_option_raises_at_first_call_of_the_compiled_model():
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    grid = torch.tensor([[4, 6]])
    pixel_values = torch.randn(24, 3, 14, 14)
    compiled = torch.compile(model, backend="kimi_cg", options={"batch_cache_size": -1})  # deferred: no error yet
    with torch.no_grad(), pytest.raises(ValueError, match="batch_cache_size.*-1"):
        compiled(pixel_values, grid)


def compile_tiny_tower_and_compare(options: dict) -> None:
    """The tiny MoonViT compiled with ``options``, called on a 24- then a 36-patch image: equal to eager."""
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options=options)
    with torch.no_grad():
        for grid in ([[4, 6]], [[6, 6]]):
            grid = torch.tensor(grid)
            pixel_values = torch.randn(int(grid.prod()), 3, 14, 14)
            for got, want in zip(compiled(pixel_values, grid), model(pixel_values, grid)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budgets, eager_fallbacks", [([64, 16], 0), ([16], 1)])
def test_valid_options_still_compile_and_match_eager(budgets, eager_fallbacks):
    """The user's bucket list is honoured. The first call (24 patches) builds the RoPE table and runs the
    plain program (NOTE [a graph that builds module state]); the second (36) runs the program dynamic in
    the patch count (NOTE [dynamic first trace]): a 64-patch bucket takes it, a list of only 16 sends it to
    the non-graphed program."""
    compile_tiny_tower_and_compare({"token_budgets": budgets, "cuda_graphs": True, "max_items": 2, "debug_dir": None})
    assert kimi_cg.counters["lift_fallbacks"] == 0
    assert kimi_cg.counters["eager_fallbacks"] == eager_fallbacks


def test_inductor_config_is_stored_sorted_and_keys_the_device_program():
    from kimi_cg.device_program import get_device_program

    config = KimiCGConfig.from_options({"inductor_config": {"max_autotune": True, "epilogue_fusion": False}})
    assert config.inductor_config == (("epilogue_fusion", False), ("max_autotune", True))
    assert KimiCGConfig(inductor_config=config.inductor_config) == config  # its stored form is accepted again
    assert KimiCGConfig.from_options({"inductor_config": {}}).inductor_config is None
    assert config.compute_hash() != KimiCGConfig().compute_hash()
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    plain, tuned = get_device_program(gm, "inductor"), get_device_program(gm, "inductor", inductor_config=config.inductor_config)
    assert plain is not tuned and tuned.inductor_config == config.inductor_config
    assert get_device_program(gm, "eager", inductor_config=config.inductor_config) is get_device_program(gm, "eager")


def test_inductor_config_is_in_force_only_while_kimi_cg_compiles(monkeypatch):
    import torch._inductor.config as inductor_config

    from kimi_cg import device_program

    seen = []
    original = device_program._compile_with_inductor

    def recording(*args, **kwargs):
        seen.append((inductor_config.epilogue_fusion, inductor_config.max_fusion_size))
        return original(*args, **kwargs)

    monkeypatch.setattr(device_program, "_compile_with_inductor", recording)
    before = (inductor_config.epilogue_fusion, inductor_config.max_fusion_size)
    compile_tiny_tower_and_compare({"device_compiler": "inductor",
                                    "inductor_config": {"epilogue_fusion": not before[0], "max_fusion_size": 7}})
    assert seen and all(settings == (not before[0], 7) for settings in seen), seen
    assert (inductor_config.epilogue_fusion, inductor_config.max_fusion_size) == before
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0
