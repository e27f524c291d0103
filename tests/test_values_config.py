"""``sim/config.py`` by value (issue 26): the one-line errors (file, line,
key), the readers' bounds at the bound and one past, ``--set`` parsing and
merging, YAML 1.2 scalars, the deployment's cross-field checks. The
expected lines are written by hand from the rules each function states
(the bounds' own rows are in ``tests/test_values_bounds.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.config import (
    ConfigError,
    DeploymentConfig,
    ModelConfig,
    apply_overrides,
    check_bound,
    check_partition,
    describe_yaml_error,
    load_model,
    load_yaml_text,
    parse_override,
    read_text,
    read_yaml,
    validate,
)
from sim.paths import SCENARIOS_DIR

FLASH_NEXT = SCENARIOS_DIR / "models" / "flash-next.yaml"


# ------------------------------------------------------------ deployment
def test_a_bound_is_allowed_and_one_past_names_field_value_bound_and_reason():
    check_bound("max_model_len", 10, 10, "why")
    with pytest.raises(ValueError) as refused:
        check_bound("max_model_len", 11, 10, "why")
    assert str(refused.value) == "max_model_len: 11 is more than 10 (why)"


def test_a_deployment_bound_is_checked_with_its_reason():
    with pytest.raises(ConfigError) as refused:
        validate(DeploymentConfig, {"kv_cache_memory_bytes": 10**12 + 1}, "d.yaml")
    assert str(refused.value) == (
        "d.yaml: (top level): kv_cache_memory_bytes: 1e+12 is more than 1e+12 (no GPU has more than 288 GB)"
    )
    with pytest.raises(
        ConfigError, match=r"^d.yaml: \(top level\): block_size: 1e\+07 is more than 1e\+07 \(no request"
    ):
        validate(DeploymentConfig, {"block_size": 10**7 + 1}, "d.yaml")


@pytest.mark.parametrize(
    ("unit", "block", "ok"), [(64, 4096, True), (64, 4160, True), (64, 4100, False), (None, 4100, True)]
)
def test_the_prefix_match_unit_must_divide_a_given_block_size(unit, block, ok):
    data = {"prefix_match_unit": unit, "block_size": block}
    if ok:
        assert validate(DeploymentConfig, data, "d").block_size == block
        return
    with pytest.raises(ConfigError) as refused:
        validate(DeploymentConfig, data, "d")
    assert str(refused.value) == (
        "d: (top level): prefix_match_unit 64 does not divide block_size 4100: prefix hits land on "
        "a grid of prefix_match_unit tokens inside each block"
    )


def test_a_unit_with_no_block_size_is_checked_later():
    assert (
        validate(DeploymentConfig, {"prefix_match_unit": 7, "block_size": None}, "d").prefix_match_unit == 7
    )


def test_the_layer_partition_has_one_stage_per_pp_rank_each_with_a_layer():
    ok = validate(DeploymentConfig, {"pipeline_parallel_size": 3, "layer_partition": [1, 1, 46]}, "d")
    assert ok.layer_partition == (1, 1, 46)
    with pytest.raises(ConfigError) as refused:
        validate(DeploymentConfig, {"pipeline_parallel_size": 3, "layer_partition": [24, 24]}, "d")
    assert str(refused.value) == "d: (top level): layer_partition has 2 stages, pipeline_parallel_size is 3"
    with pytest.raises(ConfigError) as refused:
        validate(DeploymentConfig, {"layer_partition": [48, 0]}, "d")
    assert str(refused.value) == "d: (top level): layer_partition: every stage needs at least one layer"


def test_the_partition_must_cover_the_models_layers():
    model = load_model(FLASH_NEXT)
    assert model.num_layers == 48
    check_partition(model, DeploymentConfig(layer_partition=(25, 23)))
    with pytest.raises(ConfigError) as refused:
        check_partition(model, DeploymentConfig(layer_partition=(25, 24)))
    assert str(refused.value) == (
        f"deployment.layer_partition [25, 24] covers 49 layers, model {model.name!r} has 48"
    )


def test_qsa_layers_are_every_nth_from_the_offset():
    model = load_model(FLASH_NEXT)
    every, offset = model.qsa.every, model.qsa.offset
    chosen = [i for i in range(model.num_layers) if model.is_qsa_layer(i)]
    assert chosen == list(range(offset, model.num_layers, every)) and len(chosen) > 1


# ---------------------------------------------------- validation messages
def test_an_unknown_key_wins_over_the_missing_ones_it_explains():
    data = read_yaml(FLASH_NEXT)
    data.pop("num_layers")
    data["num_layer"] = 48
    with pytest.raises(ConfigError) as refused:
        validate(ModelConfig, data, "m.yaml")
    assert str(refused.value) == "m.yaml: unknown key 'num_layer'"


def test_a_nested_bad_value_names_its_dotted_key_without_pydantics_prefix():
    data = read_yaml(FLASH_NEXT)
    data["ple"]["layer"] = 48
    with pytest.raises(ConfigError) as refused:
        validate(ModelConfig, data, "m.yaml")
    assert str(refused.value) == "m.yaml: (top level): ple.layer 48 is past the last layer (47)"
    data["ple"]["layer"] = "x"
    with pytest.raises(ConfigError, match=r"^m.yaml: ple.layer: Input should be a valid integer"):
        validate(ModelConfig, data, "m.yaml")


def test_a_yaml_file_of_one_mib_is_read_and_one_byte_more_is_refused(tmp_path):
    """Settings files are at most 1 MiB (a page of settings, not data)."""
    path = tmp_path / "s.yaml"
    path.write_text("a: 1\n#" + "x" * ((1 << 20) - 7) + "\n")
    assert path.stat().st_size == 1 << 20 and read_yaml(path) == {"a": 1}
    path.write_text("a: 1\n#" + "x" * ((1 << 20) - 6) + "\n")
    with pytest.raises(ConfigError, match=r"s.yaml: 1,048,577 bytes: more than 1,048,576, too large"):
        read_yaml(path)


def test_a_bad_key_in_a_model_file_names_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(FLASH_NEXT.read_text() + "num_layer: 3\n")
    with pytest.raises(ConfigError) as refused:
        load_model(path)
    assert str(refused.value) == f"{path}: unknown key 'num_layer'"


def test_a_model_file_that_is_not_a_mapping_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as refused:
        load_model(path)
    assert str(refused.value) == f"{path}: expected a mapping of model keys"


# ---------------------------------------------------------------- readers
def test_a_file_of_exactly_max_bytes_is_read_and_one_byte_more_is_refused(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("x" * 1000)
    assert read_text(path, max_bytes=1000) == "x" * 1000
    path.write_text("x" * 1001)
    with pytest.raises(ConfigError) as refused:
        read_text(path, max_bytes=1000)
    assert str(refused.value) == f"{path}: 1,001 bytes: more than 1,000, too large for its kind"
    assert read_text(path) == "x" * 1001  # no bound given


def test_a_missing_file_says_why_it_cannot_be_read(tmp_path):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError) as refused:
        read_text(path)
    assert str(refused.value) == f"{path}: cannot read (No such file or directory)"


def test_a_bad_byte_is_named_with_its_line_and_a_bom_is_dropped(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"one\ntwo\nth\xffree\n")
    with pytest.raises(ConfigError) as refused:
        read_text(path)
    assert str(refused.value) == f"{path}:3: not UTF-8 text (byte 0xff)"
    path.write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert read_text(path) == "a: 1\n"
    # Lines are counted from the first byte: a file opening with a newline.
    path.write_bytes(b"\n\xfe")
    with pytest.raises(ConfigError, match=r"f.txt:2: not UTF-8 text \(byte 0xfe\)$"):
        read_text(path)


def test_the_error_builder_is_the_callers():
    path = Path("/nowhere/x")

    def mine(where: Path, line: int | None, problem: str) -> ConfigError:
        return ConfigError(f"mine {where} {line} {problem}")

    with pytest.raises(ConfigError, match=r"^mine /nowhere/x None cannot read"):
        read_text(path, error=mine)


def test_an_empty_yaml_file_is_an_empty_mapping_and_a_bad_one_names_its_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("# nothing\n")
    assert read_yaml(path) == {}
    path.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(ConfigError) as refused:
        read_yaml(path)
    assert str(refused.value) == f"{path}: line 3: expected ',' or ']', but got '<stream end>'"


def test_yaml_nested_past_the_recursion_limit_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 600 + "]" * 600)
    with pytest.raises(ConfigError) as refused:
        read_yaml(path)
    assert str(refused.value) == f"{path}: nested too deeply"


def test_a_yaml_error_without_a_mark_or_a_problem_still_reads():
    assert describe_yaml_error(yaml.YAMLError("x")) == ": invalid YAML"
    error = yaml.MarkedYAMLError(problem="bad\n   thing")
    assert describe_yaml_error(error) == ": bad thing"


def test_yaml_12_scalars_on_off_stay_strings_and_exponents_are_floats():
    assert load_yaml_text("a: on\nb: off\nc: yes\nd: true\ne: FALSE\nf: 4.1e9\ng: 1E-3\nh: 1_000") == {
        "a": "on",
        "b": "off",
        "c": "yes",
        "d": True,
        "e": False,
        "f": 4.1e9,
        "g": 0.001,
        "h": 1000,
    }


def test_yaml_aliases_are_refused_with_their_position():
    with pytest.raises(yaml.YAMLError, match="aliases"):
        load_yaml_text("a: &x 1\nb: *x\n")


# -------------------------------------------------------------- overrides
def test_an_override_is_a_dotted_key_and_a_yaml_value():
    assert parse_override("deployment.max_num_seqs=16") == (["deployment", "max_num_seqs"], 16)
    assert parse_override(" seed =7") == (["seed"], 7)
    assert parse_override("a.b=on") == (["a", "b"], "on")
    assert parse_override("a=x=y") == (["a"], "x=y")
    # A value YAML cannot read is kept as its text.
    assert parse_override("a=[1, 2") == (["a"], "[1, 2")
    assert parse_override("a=") == (["a"], None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed", "--set 'seed': expected key=value"),
        (" =3", "--set ' =3': expected key=value"),
        ("a..b=1", "--set 'a..b=1': expected a dotted key like deployment.max_num_seqs"),
        (".a=1", "--set '.a=1': expected a dotted key like deployment.max_num_seqs"),
    ],
)
def test_a_bad_override_is_one_line(text, message):
    with pytest.raises(ConfigError) as refused:
        parse_override(text)
    assert str(refused.value) == message


def test_an_override_nested_too_deeply_is_one_line():
    with pytest.raises(ConfigError) as refused:
        parse_override("a.b=" + "[" * 600 + "]" * 600)
    assert str(refused.value) == "--set a.b: value nested too deeply"


def test_overrides_apply_in_order_to_a_copy_making_or_replacing_mappings():
    data = {"a": {"b": 1, "c": [1, {"d": 2}]}, "e": 5}
    result = apply_overrides(data, ["a.b=2", "e.f=3", "g.h.i=4", "a.b=9"])
    assert result == {"a": {"b": 9, "c": [1, {"d": 2}]}, "e": {"f": 3}, "g": {"h": {"i": 4}}}
    # The input is untouched, its nested lists and mappings too.
    result["a"]["c"][1]["d"] = 99
    result["a"]["c"].append(0)
    assert data == {"a": {"b": 1, "c": [1, {"d": 2}]}, "e": 5}
