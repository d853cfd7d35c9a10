"""`radixflow bench evict` runs both trees on the same requests (asserts on counts, not times)."""
from radixflow.services.bench.evict import WalkTree, _fill_and_admit, run_evict


def test_bench_evict_runs_both_trees_on_the_same_evictions():
    out = run_evict(sizes=(200,), admissions=40)
    (row,) = out["rows"]
    assert row["cached_suffixes"] == 200 and row["evicted_pages"] >= 40 * 2     # every admission evicted
    assert row["admission_ms_walk"] > 0 and row["admission_ms_heap"] > 0


def test_the_baseline_walks_the_whole_tree():
    calls = []

    class Counting(WalkTree):
        def nodes(self, owners=None, exact=False):
            calls.append(owners)
            return super().nodes(owners, exact)
    _fill_and_admit(Counting, 100, 10)
    assert calls and all(o == ["default"] for o in calls)
