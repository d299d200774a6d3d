"""Config precedence: defaults < task < attn (+ its per-task section) < preset < task's preset section < --set."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from attentions import build_config, load_attention_module, registry
from lra import config
from lra.errors import UserError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_attention.py"


@pytest.fixture
def configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for sub in ("tasks", "attn", "presets"):
        (tmp_path / sub).mkdir()
    (tmp_path / "tasks" / "listops.yaml").write_text(
        "train: {lr: 0.5, steps: 11, batch_size: 7}\nmodel: {dim: 32}\n"
        "presets:\n  fast: {train: {steps: 33}}\n"
    )
    (tmp_path / "attn" / "topk.yaml").write_text("topk: 16\ntasks:\n  listops: {topk: 24}\n  text: {topk: 99}\n")
    (tmp_path / "attn" / "full.yaml").write_text("{}\n")
    (tmp_path / "presets" / "fast.yaml").write_text("train: {steps: 22, lr: 0.25}\n")
    (tmp_path / "presets" / "paper.yaml").write_text("")
    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path)
    return tmp_path


def test_precedence_of_every_layer(configs: Path) -> None:
    cfg = config.resolve("listops", "topk", "fast", ["train.batch_size=5"])
    # defaults survive where nothing overrides them
    assert cfg.model.num_layers == 2
    # task file over defaults
    assert cfg.model.dim == 32
    # attn per-task section over the attn file
    assert cfg.attn_options == {"topk": 24}
    # generic preset over task file; the task's preset section over the generic preset
    assert cfg.train.lr == 0.25 and cfg.train.steps == 33
    # --set over everything
    assert cfg.train.batch_size == 5


def test_a_users_config_file_sits_between_the_preset_and_set(configs: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("train: {steps: 44, batch_size: 9}\nattn: {topk: 12}\n")
    cfg = config.resolve("listops", "topk", "fast", ["train.batch_size=5"], configs=[str(mine)])
    # over the task's preset section (steps 33) and the backend file (topk 24); under --set (batch 5)
    assert (cfg.train.steps, cfg.attn_options["topk"], cfg.train.batch_size) == (44, 12, 5)
    with pytest.raises(UserError, match=r"--config .*nothere.yaml: no such file"):
        config.resolve("listops", "topk", "fast", configs=[str(tmp_path / "nothere.yaml")])
    mine.write_text("trian: {steps: 1}\n")
    with pytest.raises(UserError, match=r"mine.yaml: unknown section 'trian'"):
        config.resolve("listops", "topk", "fast", configs=[str(mine)])


def test_a_missing_yaml_of_a_task_or_built_in_backend_is_an_error(configs: Path) -> None:
    # an installation without its package data must not train with dataclass defaults
    with pytest.raises(UserError, match=r"built-in attention 'mita' has no configuration file .*mita.yaml"):
        config.resolve("listops", "mita", "paper")
    with pytest.raises(UserError, match=r"task 'text' has no configuration file .*text.yaml"):
        config.resolve("text", "full", "paper")


def test_set_reaches_backend_options_with_types(configs: Path) -> None:
    cfg = config.resolve("listops", "topk", "paper", ["attn.topk=8"])
    assert cfg.attn_options["topk"] == 8
    with pytest.raises(UserError, match=r"topk must be int"):
        config.resolve("listops", "topk", "paper", ["attn.topk=eight"])
    with pytest.raises(UserError, match=r"unknown option 'kk' for attention 'topk'; valid: .*topk"):
        config.resolve("listops", "topk", "paper", ["attn.kk=8"])


@pytest.mark.parametrize(
    "sets, match",
    [
        (["train.lrr=1"], r"unknown key train\.lrr; valid: steps, batch_size, lr"),
        (["trian.lr=1"], r"unknown section 'trian'"),
        (["train.steps=ten"], r"train\.steps must be int, got 'ten'"),
        (["train.lr=fast"], r"train\.lr must be float"),
        (["model.pooling=max"], r"model\.pooling must be one of mean, cls"),
        (["lr=3"], r"must look like section\.key=value"),
    ],
    ids=["unknown-key", "unknown-section", "int-type", "float-type", "choice", "no-section"],
)
def test_bad_overrides_name_the_key(configs: Path, sets: list, match: str) -> None:
    with pytest.raises(UserError, match=match):
        config.resolve("listops", "full", "paper", sets)


def test_int_is_accepted_for_float(configs: Path) -> None:
    assert config.resolve("listops", "full", "paper", ["train.lr=1"]).train.lr == 1.0


def test_unknown_preset_lists_valid_ones(configs: Path) -> None:
    with pytest.raises(UserError, match=r"unknown preset 'slow'; valid: fast, paper"):
        config.resolve("listops", "full", "slow")


def test_unknown_key_in_a_yaml_file_names_the_file(configs: Path) -> None:
    (configs / "presets" / "bad.yaml").write_text("train: {stepz: 3}\n")
    with pytest.raises(UserError, match=r"bad\.yaml: unknown key train\.stepz"):
        config.resolve("listops", "full", "bad")


def test_malformed_yaml_is_one_line_naming_the_file(configs: Path) -> None:
    (configs / "presets" / "broken.yaml").write_text("train: {steps: 3\n")
    with pytest.raises(UserError, match=r"broken\.yaml.*malformed YAML") as err:
        config.resolve("listops", "full", "broken")
    assert "\n" not in str(err.value)


def test_shipped_configs_resolve_for_every_task_and_backend() -> None:
    from attentions import list_attentions
    from lra.tasks import list_tasks

    for task in list_tasks():
        for attn in list_attentions():
            for preset in config.list_presets():
                try:
                    config.resolve(task, attn, preset)
                except UserError as err:
                    # only a per-task preset that this task lacks, or refuses with a reason, may refuse
                    assert (f"preset {preset!r} has no values for task {task!r}" in str(err)
                            or f"preset {preset!r} is refused for task {task!r}: " in str(err))


def test_exponent_without_a_dot_is_a_number(configs: Path) -> None:
    # YAML 1.1 reads "3e-4" as a string; users write learning rates that way
    assert config.resolve("listops", "full", "paper", ["train.lr=3e-4"]).train.lr == 3e-4
    (configs / "presets" / "exp.yaml").write_text("train: {lr: 2e-3}\n")
    assert config.resolve("listops", "full", "exp").train.lr == 2e-3


def test_an_attention_option_written_3e_4_is_a_float(configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the example backend's init_scale is a float; forgotten after the test
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_loaded_files", dict(registry._loaded_files))
    load_attention_module(str(EXAMPLE))
    mine = tmp_path / "mine.yaml"
    mine.write_text("attn: {init_scale: 3e-4}\n")
    # YAML 1.1 reads 3e-4 (no dot) as a string: the backend's option takes it as the number, as train.lr does
    assert yaml.safe_load(mine.read_text())["attn"]["init_scale"] == "3e-4"
    cfg = config.resolve("listops", "myattn", "paper", configs=[str(mine)])
    assert build_config("myattn", cfg.attn_options).init_scale == 3e-4
    # a bool is never a number, and a word is not one either; the error names the key
    for value, shown in [("true", "True"), ("fast", "'fast'")]:
        mine.write_text(f"attn: {{init_scale: {value}}}\n")
        with pytest.raises(UserError, match=rf"attn\.init_scale must be float, got {shown}"):
            config.resolve("listops", "myattn", "paper", configs=[str(mine)])


def test_a_per_task_preset_refuses_a_task_without_values(configs: Path) -> None:
    (configs / "presets" / "cpu.yaml").write_text("tasks_required: true\ntrain: {steps: 2}\n")
    (configs / "tasks" / "listops.yaml").write_text("presets:\n  cpu: {train: {steps: 9}}\n")
    (configs / "tasks" / "text.yaml").write_text("{}\n")
    assert config.resolve("listops", "full", "cpu").train.steps == 9
    with pytest.raises(UserError, match=r"preset 'cpu' has no values for task 'text'.*exists for: listops"):
        config.resolve("text", "full", "cpu")


def test_a_task_refuses_a_preset_with_its_reason(configs: Path) -> None:
    (configs / "presets" / "cpu.yaml").write_text("tasks_required: true\n")
    (configs / "presets" / "smoke.yaml").write_text("tasks_required: true\n")
    (configs / "tasks" / "text.yaml").write_text(
        "presets:\n  smoke: {}\nrefused_presets:\n  cpu: too slow here\n")
    with pytest.raises(UserError, match=r"^preset 'cpu' is refused for task 'text': too slow here; use --preset paper, smoke$"):
        config.resolve("text", "full", "cpu")
    assert config.resolve("text", "full", "smoke").preset == "smoke"


def test_smoke_is_refused_for_path_x_and_kept_for_every_other_task() -> None:
    from lra.tasks import list_tasks

    with pytest.raises(UserError, match=r"preset 'smoke' is refused for task 'pathx': .*30 s"):
        config.resolve("pathx", "full", "smoke")
    for task in set(list_tasks()) - {"pathx"}:
        assert config.resolve(task, "full", "smoke").train.steps == 20
