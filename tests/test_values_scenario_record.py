"""Value tests of the scenario record (``sim/scenario.py``:
``scenario_to_dict`` / ``scenario_from_record``; issue 41: no mutation run
had reached them). The record is JSON data with every key, the one key the
async engine refuses left out; loading it back is as strict as a scenario
file, every error one line naming the record's path.

Expected values: the scenario files' own text (docs/results.md: the record
holds every key, defaults included) and JSON's own types.
"""

from __future__ import annotations

import json

import pytest

from sim.config import ConfigError
from sim.scenario import load_scenario, scenario_from_record, scenario_to_dict

SOURCE = "r/scenario.json"


def _sync_and_async():
    sync = load_scenario("chat-slice", ["engine.mode=sync"])
    return sync, load_scenario("chat-slice")


def test_the_record_is_json_data_with_every_key():
    """JSON types (lists, not tuples; plain strings), the scenario file's
    own values, and defaults the file never names."""
    sync, _ = _sync_and_async()
    record = scenario_to_dict(sync)
    assert json.loads(json.dumps(record, allow_nan=False)) == record
    assert record["name"] == "chat-slice" and record["engine"]["mode"] == "sync"
    assert (record["deployment"]["block_size"], record["deployment"]["prefix_match_unit"]) == (4096, 64)
    assert record["scheduler"]["max_num_batched_tokens"] == 1024
    assert record["workload"]["window_s"] == [0.0, 600.0]  # a tuple in the scenario, a list in JSON
    assert record["scheduler"]["max_concurrent_batches"] == 2  # a default the file never names


def test_only_the_async_record_leaves_out_max_concurrent_batches():
    """Under ``engine.mode: async`` the engine derives the batches in flight
    and refuses the key named: the record drops it and nothing else."""
    sync, asynchronous = _sync_and_async()
    sync_record, async_record = scenario_to_dict(sync), scenario_to_dict(asynchronous)
    assert set(sync_record["scheduler"]) - set(async_record["scheduler"]) == {"max_concurrent_batches"}
    assert set(async_record["scheduler"]) <= set(sync_record["scheduler"])
    assert scenario_from_record(async_record, SOURCE) == asynchronous
    assert scenario_from_record(sync_record, SOURCE) == sync
    # Control: the key named under async is what the loader refuses.
    named = json.loads(json.dumps(async_record))
    named["scheduler"]["max_concurrent_batches"] = 2
    refused = r"^r/scenario.json: \(top level\): scheduler.max_concurrent_batches: 2 with engine.mode: async"
    with pytest.raises(ConfigError, match=refused):
        scenario_from_record(named, SOURCE)


@pytest.mark.parametrize("data", [[], None, "default", 3, [("name", "x")]])
def test_a_record_that_is_not_a_mapping_is_one_line_naming_it(data):
    with pytest.raises(ConfigError) as caught:
        scenario_from_record(data, SOURCE)
    assert str(caught.value) == "r/scenario.json: expected a mapping of scenario keys"


def _record(**changes) -> dict:
    record = scenario_to_dict(load_scenario("chat-slice", ["engine.mode=sync"]))
    for section, values in changes.items():
        record[section].update(values)
    return record


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"scheduler": {"no_such_key": 1}}, r"^r/scenario.json: unknown key 'scheduler.no_such_key'$"),
        # The rig's profile dropped, one rate for K = 3: the model check.
        (
            {"mtp": {"acceptance_rates": [0.5], "acceptance_profile": None}},
            r"^r/scenario.json: mtp.acceptance_rates: 1 rates given, model 'flash-next' drafts 3",
        ),
        # A step-time coefficient the model does not have: the step-time check.
        ({"step_time": {"no_such_coefficient": 1.0}}, r"^r/scenario.json: step_time"),
    ],
)
def test_a_record_is_checked_as_a_scenario_file_is_naming_the_record(changes, message):
    with pytest.raises(ConfigError, match=message) as caught:
        scenario_from_record(_record(**changes), SOURCE)
    assert "\n" not in str(caught.value)
