"""The replay's I/O by value: the requests and samples frames from hand
records, what the client sends and records against the fault server
(``tests/helpers/fault_server.py``, whose page and streams state their
values), the token-id mapping against SplitMix64's published outputs, and
the launcher (its command, the boot-log check, a server process started
and stopped in a ``finally``). Every server listens on 127.0.0.1 and every
wait is bounded."""

from __future__ import annotations

from sim.serving.client import _mix64, map_token_ids

# SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference splitmix64.c)
# seeded with 0: its first outputs, the finaliser applied to 1, 2, 3, 4
# times the golden gamma 0x9E3779B97F4A7C15 (the finaliser adds one gamma
# itself, so the inputs are 0, gamma, 2 gamma, 3 gamma).
GAMMA = 0x9E3779B97F4A7C15
SPLITMIX64_SEED_0 = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC)


def test_mix64_is_splitmix64s_finaliser():
    inputs = [(i * GAMMA) % 2**64 for i in range(4)]
    assert tuple(_mix64(x) for x in inputs) == SPLITMIX64_SEED_0


def test_token_ids_map_through_the_mix_modulo_the_vocabulary():
    assert map_token_ids([0, 0, 5], 1000) == [0xE220A8397B1DCDAF % 1000] * 2 + [_mix64(5) % 1000]
    assert map_token_ids([0], 1000) == [0xE220A8397B1DCDAF % 1000] == [535]
    assert map_token_ids([3, 70000], None) == [3, 70000]
