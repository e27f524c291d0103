"""MTP's prefix-cache hashing switches, as vLLM 0.33.0 derives them
(``VllmConfig.num_prefill_lookahead_tokens`` / ``num_hash_lookahead_tokens``
in ``vllm/config/vllm.py``, then ``Scheduler.__init__``, which turns the
EAGLE block drop off under lookahead hashes). Each row's triple is read off
those properties by hand: (use_eagle_block_drop, hash lookahead, prefill
lookahead)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sim.kv_cache_manager import MTPHashing


@pytest.mark.parametrize(
    "mode, num_spec, multi_module, caching, connector, expected",
    [
        # No drafts: no drafter to read ahead; vLLM's scheduler keeps the drop off.
        ("lookahead", 0, False, True, False, (False, 0, 0)),
        ("eagle-drop", 0, True, True, False, (False, 0, 0)),
        # One MTP module reads the next token only (prefill lookahead 1); the
        # lookahead hashes cover it and replace the drop.
        ("lookahead", 3, False, True, False, (False, 1, 1)),
        ("lookahead", 1, False, True, False, (False, 1, 1)),
        ("eagle-drop", 3, False, True, False, (True, 0, 1)),
        # Multi-module MTP: the chain reads K tokens ahead.
        ("lookahead", 3, True, True, False, (False, 3, 3)),
        ("eagle-drop", 3, True, True, False, (True, 0, 3)),
        # Legacy hashes without prefix caching or with a KV connector: the drop stays.
        ("lookahead", 3, False, False, False, (True, 0, 1)),
        ("lookahead", 3, True, True, True, (True, 0, 3)),
    ],
)
def test_the_hashing_vllm_derives(mode, num_spec, multi_module, caching, connector, expected):
    hashing = MTPHashing.for_hash_mode(
        mode,
        num_speculative_tokens=num_spec,
        multi_module_mtp=multi_module,
        enable_prefix_caching=caching,
        kv_connector=connector,
    )
    assert hashing == MTPHashing(
        use_eagle_block_drop=expected[0],
        num_hash_lookahead_tokens=expected[1],
        num_prefill_lookahead_tokens=expected[2],
    )


def test_an_unknown_mode_names_the_modes():
    with pytest.raises(
        ValueError, match=r"^mtp_hash_mode must be one of \('eagle-drop', 'lookahead'\), got 'ahead'$"
    ):
        MTPHashing.for_hash_mode("ahead", num_speculative_tokens=3)  # type: ignore[arg-type]


def _engine(num_spec: int | None, *, multi_module: bool = False, connector: bool = False) -> SimpleNamespace:
    """The two engine-config fields the derivation reads (vLLM's names)."""
    speculative = (
        None
        if num_spec is None
        else SimpleNamespace(num_speculative_tokens=num_spec, use_multi_module_mtp=lambda: multi_module)
    )
    return SimpleNamespace(speculative_config=speculative, kv_transfer_config=object() if connector else None)


@pytest.mark.parametrize(
    "engine, caching, expected",
    [
        (_engine(None), True, (False, 0, 0)),  # no speculative config
        (_engine(3), True, (False, 1, 1)),  # prefix caching on by default
        (_engine(3), False, (True, 0, 1)),
        (_engine(3, multi_module=True), True, (False, 3, 3)),
        (_engine(3, connector=True), True, (True, 0, 1)),
    ],
    ids=["no-spec", "mtp", "no-caching", "multi-module", "connector"],
)
def test_the_hashing_an_engine_config_gives(engine, caching, expected):
    """``for_engine`` reads K, the multi-module switch and the connector off
    the engine config; prefix caching is on unless said otherwise."""
    kwargs = {} if caching else {"enable_prefix_caching": False}
    hashing = MTPHashing.for_engine("lookahead", engine, **kwargs)
    assert (
        hashing.use_eagle_block_drop,
        hashing.num_hash_lookahead_tokens,
        hashing.num_prefill_lookahead_tokens,
    ) == expected
