"""sum_stats: the replicas' front end reports one engine's stats as the sum of its replicas'."""

from kvgen.engine.base import EngineStats, sum_stats


def test_counts_add_up_and_tiers_add_up_by_name():
    a = EngineStats(num_running=1, num_waiting=2, kv_blocks_used=3, kv_blocks_total=10,
                    kv_tiers=(("host", {"blocks": 4.0, "hits": 1.0}),))
    b = EngineStats(num_running=2, num_waiting=0, kv_blocks_used=5, kv_blocks_total=10,
                    kv_tiers=(("host", {"blocks": 1.0, "hits": 2.0}), ("disk", {"blocks": 7.0})))
    total = sum_stats([a, b])
    assert (total.num_running, total.num_waiting, total.kv_blocks_used, total.kv_blocks_total) == (3, 2, 8, 20)
    assert dict(total.kv_tiers) == {"host": {"blocks": 5.0, "hits": 3.0}, "disk": {"blocks": 7.0}}


def test_replicas_without_tiers_sum_to_no_tiers():
    one = EngineStats(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=4)
    assert sum_stats([one, one]).kv_tiers == () and sum_stats([one, one]).kv_blocks_total == 8
