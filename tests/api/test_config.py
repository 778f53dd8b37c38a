"""The frozen config: recipes, validation, TOML round trip, identity, and the flags generated from it."""

from __future__ import annotations

import dataclasses

import pytest
from cpu import AVX2_ONLY, host_cpu_flags

from ddpkit.cli import build_parser
from ddpkit.commands.flags import config_from_args
from ddpkit.config import TrainConfig
from ddpkit.errors import ConfigError


def test_recipe_fills_unset_fields_and_flags_win():
    # conftest pins the CPU flags of in-process tests to an AVX2-only CPU: the fp32 recipe.
    cfg = TrainConfig(dataset="mnist").resolved()
    assert cfg.recipe == "mnist" and cfg.model == "convnet" and cfg.lr == 0.1 and cfg.batch_size == 128
    assert cfg.amp == "none"
    cfg = TrainConfig(dataset="mnist", lr=0.3, model="mlp").resolved()
    assert cfg.lr == 0.3 and cfg.model == "mlp"
    assert TrainConfig(dataset="cifar10").resolved().model == "resnet9"


@pytest.mark.parametrize(
    "flags,kwargs,expected",
    [
        (AVX2_ONLY, {}, "mnist"),
        (AVX2_ONLY | {"avx512f", "avx512_bf16"}, {}, "mnist-cpu-bf16"),  # AVX512 with native bf16
        (AVX2_ONLY | {"amx_bf16", "amx_tile"}, {}, "mnist-cpu-bf16"),  # AMX (Sapphire Rapids and later)
        (AVX2_ONLY | {"avx512f"}, {}, "mnist"),  # AVX512 without bf16: emulated, so fp32
        (frozenset(), {}, "mnist"),  # no /proc/cpuinfo (macOS) or no flags line
        (AVX2_ONLY | {"avx512_bf16"}, {"dtype": "float64"}, "mnist"),  # float64 asks for exactness, not speed
        (AVX2_ONLY | {"avx512_bf16"}, {"dataset": "fashion-mnist"}, "mnist-cpu-bf16"),
        (AVX2_ONLY | {"avx512_bf16"}, {"dataset": "cifar10"}, "cifar10-resnet9"),
        (AVX2_ONLY | {"avx512_bf16"}, {"recipe": "mnist"}, "mnist"),  # an explicit recipe is never second-guessed
    ],
)
def test_recipe_auto_is_a_function_of_the_cpu_flags(flags, kwargs, expected):
    from ddpkit import recipes

    cfg = TrainConfig(**{"dataset": "mnist", "device": "cpu", **kwargs})
    assert recipes.pick(cfg, flags) == expected
    resolved = recipes.apply(cfg, flags)
    assert resolved.recipe == expected and resolved.amp == ("bf16" if expected == "mnist-cpu-bf16" else "none")


def test_a_gpu_run_never_takes_the_cpu_bf16_recipe(monkeypatch):
    import torch

    from ddpkit import recipes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert recipes.pick(TrainConfig(dataset="mnist", device="auto"), frozenset({"avx512_bf16"})) == "mnist"
    assert recipes.pick(TrainConfig(dataset="mnist", device="cuda"), frozenset({"avx512_bf16", "amx_bf16"})) == "mnist"


def test_cpu_flags_are_the_flags_line_of_proc_cpuinfo():
    from ddpkit.recipes import parse_cpu_flags

    x86 = "processor\t: 0\nmodel name\t: Xeon avx512_bf16\nflags\t\t: fpu sse avx2 avx512_bf16\n\nprocessor\t: 1\n"
    assert parse_cpu_flags(x86) == frozenset({"fpu", "sse", "avx2", "avx512_bf16"})
    assert parse_cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n") == frozenset()  # arm64: not read
    assert parse_cpu_flags("") == frozenset()
    # oneDNN capped below bf16 (ONEDNN_MAX_CPU_ISA) emulates it, so the flags do not count
    assert parse_cpu_flags(x86, "AVX2") == frozenset({"fpu", "sse", "avx2"})
    assert parse_cpu_flags(x86, "avx512_core_bf16") == parse_cpu_flags(x86, "ALL") == parse_cpu_flags(x86)


def test_the_host_flags_honour_the_onednn_cap(monkeypatch):
    from ddpkit import recipes

    cpuinfo = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n"
    monkeypatch.setattr(recipes, "Path", lambda path: type("Info", (), {"read_text": lambda self: cpuinfo})())
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(variable, raising=False)
    assert host_cpu_flags() == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # oneDNN's older name
    assert host_cpu_flags() == {"avx2", "avx512f"}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # the newer name wins
    assert "amx_bf16" in host_cpu_flags()

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(recipes, "Path", lambda path: type("Info", (), {"read_text": missing})())
    assert host_cpu_flags() == frozenset()  # macOS, Windows


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().epochs = 3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dataset="nope"), "unknown dataset 'nope'"),
        (dict(model="nope"), "unknown model 'nope'"),
        (dict(epochs=0), "--epochs must be positive"),
        (dict(lr=-0.1), "--lr must be positive"),
        (dict(amp="fp8"), "--amp 'fp8' is not one of"),
        (dict(nproc="two"), "--nproc must be a positive integer or 'auto'"),
        (dict(recipe="fast"), "unknown recipe 'fast'"),
        (dict(seed=2**64), r"--seed 18446744073709551616 is out of range: give a whole number from 0 to 2\*\*63-1"),
        (dict(seed=-1), "--seed -1 is out of range"),
        (dict(nnodes=2, rdzv_endpoint="node0"), "--rdzv-endpoint must be HOST:PORT, got 'node0'"),
        (dict(save_every_steps=-1), "--save-every-steps must be >= 0"),
        (dict(keep_snapshots=0), "--keep-snapshots must be positive"),
        (dict(on_nan="ignore"), "--on-nan 'ignore' is not one of"),
        (dict(optimizer="sgd", beta2=0.95), r"--beta2 is Adam's .* got 0.95 with --optimizer sgd"),
        (dict(optimizer="adamw", beta2=1.0), r"--beta2 .* must be in \[0, 1\) .* got 1.0 with --optimizer adamw"),
        # 1e30 was an OverflowError on every rank (timedelta); 0.5 a finished run's exit 3 (rank 0's plots)
        (dict(timeout_s=1e30), r"--timeout-s 1e\+30 is out of range: give 3 to 100,000,000 seconds"),
        (dict(timeout_s=2.5), r"--timeout-s 2.5 is out of range: give 3 to 100,000,000 seconds"),
        (dict(timeout_s=1e8 + 1), r"--timeout-s 100000001 is out of range"),
        # CUDA-graph modes break with BatchNorm under DDP (pytorch/pytorch#139207, #161302)
        (dict(compile_mode="reduce-overhead"), "--compile-mode 'reduce-overhead' is not one of"),
        (dict(compile_mode="max-autotune"), "--compile-mode 'max-autotune' is not one of"),
    ],
)
def test_invalid_values_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs).resolved()


def test_the_timeout_bounds_themselves_are_accepted():
    for value in (3, 3.0, 600.0, 1e8):
        assert TrainConfig(timeout_s=value).resolved().timeout_s == value


def test_toml_round_trip_and_identity(tmp_path):
    cfg = TrainConfig(dataset="synthetic", synthetic_shape="3,16,16", epochs=3).resolved()
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    again = TrainConfig.from_toml(tmp_path / "c.toml")
    assert again == cfg and again.hash() == cfg.hash()
    assert "[optim]" in cfg.to_toml() and "lr = 0.4" in cfg.to_toml()
    moved = dataclasses.replace(cfg, run_dir="elsewhere", log_every=7)
    assert moved.hash() == cfg.hash()  # where and how verbosely a run happens is not its identity
    assert cfg.differing_keys(dataclasses.replace(cfg, seed=9, lr=1.0).to_dict()) == ["lr", "seed"]


def test_default_run_dir_is_stable_per_config():
    a, b = TrainConfig(seed=1).resolved(), TrainConfig(seed=1).resolved()
    assert a.run_dir == b.run_dir and a.run_dir.startswith("runs/mnist-convnet-")
    assert TrainConfig(seed=2).resolved().run_dir != a.run_dir


def test_unknown_toml_key(tmp_path):
    (tmp_path / "c.toml").write_text("[train]\nepoch = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): epoch \(did you mean epochs\?\)"):
        TrainConfig.from_toml(tmp_path / "c.toml")


@pytest.mark.parametrize(
    "text,message",
    [
        ("[trian]\nepochs = 1\n", r"unknown section \[trian\]; the sections are \[data\], \[model\]"),
        ("[data]\nepochs = 1\n", r"epochs belongs in \[train\], not \[data\]"),
        ("[train]\nbatch_size = 64\nbatch-size = 32\n", r"batch_size is given twice"),
    ],
)
def test_toml_sections_are_checked(tmp_path, text, message):
    """Sections were ignored: [trian], a key in the wrong section and a key given twice all passed silently."""
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_toml(tmp_path / "c.toml")


def test_toml_keys_take_the_flags_spelling_and_flat_files_still_load(tmp_path):
    (tmp_path / "c.toml").write_text("epochs = 3\n[train]\nbatch-size = 64\n")
    cfg = TrainConfig.from_toml(tmp_path / "c.toml")
    assert (cfg.epochs, cfg.batch_size) == (3, 64)


def test_flags_are_the_dataclass_fields_and_override_toml(tmp_path):
    (tmp_path / "c.toml").write_text("[train]\nepochs = 5\nseed = 4\n")
    args = build_parser().parse_args(
        ["train", "--config", str(tmp_path / "c.toml"), "--epochs", "2", "--no-progress", "--sync-bn", "--lr", "0.2"]
    )
    cfg = config_from_args(args)
    assert (cfg.epochs, cfg.seed, cfg.progress, cfg.sync_bn, cfg.lr) == (2, 4, False, True, 0.2)
    assert cfg.momentum is None  # untyped flags stay unset for the recipe


def test_cli_surface_is_frozen():
    """Every config field is a flag; renaming one is a breaking change and must be deliberate."""
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    flags = {opt for action in train._actions for opt in action.option_strings}
    for f in dataclasses.fields(TrainConfig):
        assert ("--" + f.name.replace("_", "-") in flags) == f.metadata["cli"], f.name
    assert {"--config", "--nproc", "--batch-size", "--amp", "--sync-bn", "--epochs"} <= flags


def test_fault_tolerance_and_launch_flags_do_not_change_the_run_identity():
    """A run may be resumed with other snapshot/restart/rendezvous settings: same hash, same run."""
    base = TrainConfig(dataset="mnist").resolved()
    other = TrainConfig(
        dataset="mnist",
        save_every_steps=10,
        keep_snapshots=5,
        max_restarts=3,
        on_nan="warn",
        nnodes=2,
        rdzv_endpoint="h:1",
        rdzv_id="x",
        local_addr="10.0.0.2",
    ).resolved()
    assert base.hash() == other.hash()


# ---------------------------------------------------------------- properties over every field (hypothesis)
import math  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ddpkit.config import FIELD_TYPES, tomllib  # noqa: E402

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]
TYPED = {
    int: st.integers(-(2**63), 2**63 - 1),
    float: st.floats(allow_nan=False, allow_infinity=False),
    bool: st.booleans(),
    str: st.text(),
}  # st.text(): the full Unicode range but lone surrogates
WRONG = {
    int: st.one_of(st.text(), st.floats(), st.booleans(), st.lists(st.integers(), max_size=2)),
    float: st.one_of(st.text(), st.booleans(), st.lists(st.floats(), max_size=2)),
    bool: st.one_of(st.text(), st.integers(), st.floats()),
    str: st.one_of(st.floats(), st.booleans(), st.lists(st.text(), max_size=2)),
}


def typed(name):
    typ, optional = FIELD_TYPES[name]
    return st.one_of(st.none(), TYPED[typ]) if optional else TYPED[typ]


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({name: typed(name) for name in FIELDS}))
def test_every_config_round_trips_through_toml(values):
    """Regression: a non-BMP character (an emoji in --run-dir) was written as a JSON surrogate pair, which
    TOML rejects, so the run could not be resumed. Strings with quotes, backslashes, newlines too."""
    cfg = TrainConfig(**values)
    again = TrainConfig.from_dict(tomllib.loads(cfg.to_toml()))
    assert again == cfg


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(FIELDS).flatmap(lambda name: st.tuples(st.just(name), WRONG[FIELD_TYPES[name][0]])))
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(case):
    name, value = case
    if name == "nproc" and isinstance(value, int) and not isinstance(value, bool):
        return  # a plain number is accepted for nproc
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({name: value}, "config file x.toml: ")
    assert f"config file x.toml: {name} = " in str(err.value) and "\n" not in str(err.value)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {name: typed(name) for name in FIELDS if name not in ("dataset", "model", "recipe", "task", "rdzv_endpoint")}
    )
)
def test_validation_refuses_out_of_bounds_values_only_with_config_errors(values):
    """Numbers at and beyond their bounds, any string: validation says yes, or one ConfigError; it never
    crashes with a TypeError or ValueError of its own."""
    try:
        TrainConfig(**values).resolved()
    except ConfigError as exc:
        assert "\n" not in str(exc)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_for_every_float_field(value):
    for name, (typ, _) in FIELD_TYPES.items():
        if typ is float:
            with pytest.raises(ConfigError, match=f"{name} = {value}: expected a finite number"):
                TrainConfig(**{name: value}).validate()


def test_the_registries_are_keyed_by_the_names_the_config_accepts():
    """config.py checks names before anything loads; each registry must hold exactly those names."""
    from ddpkit.config import DATASET_NAMES, LOGGER_NAMES, MODEL_NAMES
    from ddpkit.data import DATASETS
    from ddpkit.models import MODELS
    from ddpkit.run.loggers import LOGGERS

    assert tuple(DATASETS) == DATASET_NAMES and tuple(MODELS) == MODEL_NAMES and tuple(LOGGERS) == LOGGER_NAMES


def test_a_key_added_later_leaves_the_hash_alone_at_its_default():
    """cuda_graph and shuffle_in_batch joined the identity after run dirs were named by the hash: at their
    defaults the hash is the one an older ddpkit computed (so a rerun after an upgrade finds and resumes
    its run), and any other value changes it."""
    import hashlib
    import json

    cfg = TrainConfig(dataset="mnist", recipe="mnist", epochs=1).resolved()
    added = (
        *("beta2", "cuda_graph", "shuffle_in_batch", "val_fraction", "eval_every_steps", "keep_best", "early_stop"),
        "replicas",
    )
    older = {k: v for k, v in cfg.identity().items() if k not in added}
    # the older name's hash, the horizon in it (since 0.4 the name leaves it out: test_horizon.py)
    assert cfg.hash(horizon=True) == hashlib.sha256(json.dumps(older, sort_keys=True, default=str).encode()).hexdigest()
    for key, value in (
        ("val_fraction", 0.1),
        ("eval_every_steps", 5),
        ("keep_best", "val_loss"),
        ("early_stop", "val_loss:3"),
    ):
        assert dataclasses.replace(cfg, **{key: value}).hash() != cfg.hash()
    assert dataclasses.replace(cfg, cuda_graph="on").hash() != cfg.hash()
    assert dataclasses.replace(cfg, shuffle_in_batch=True).hash() != cfg.hash()
    assert dataclasses.replace(cfg, beta2=0.95).hash() != cfg.hash()
    assert dataclasses.replace(cfg, replicas=2).hash() != cfg.hash()


def test_adams_beta2_is_the_users_and_said_on_the_start_line():
    """Issue 35, item 7: the built-in adam and adamw hard-coded beta2 = 0.999 (GPT recipes use 0.95-0.99),
    and the docs never said so. Unset it is still torch's 0.999, and the [start] line says which."""
    import torch

    from ddpkit.train.optim import build_optimizer, lr_policy

    model = torch.nn.Linear(3, 2)
    for beta2, want in ((None, 0.999), (0.95, 0.95)):
        cfg = TrainConfig(optimizer="adamw", lr=1e-3, beta2=beta2, recipe="mnist").resolved()
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        assert opt.param_groups[0]["betas"] == (cfg.momentum, want)
        assert f"beta2 {want:g}" in lr_policy(cfg, opt, False, None, False)
