import pytest

from effdl.data.process_pool import map_in_processes, worker_count


def square(x: int) -> int:
    return x * x


@pytest.mark.parametrize("workers", [1, 2])
def test_ordered_results_equal_the_builtin_map(workers):
    jobs = list(range(23))
    assert list(map_in_processes(square, jobs, workers, chunksize=3)) == [x * x for x in jobs]


def test_unordered_results_are_the_same_multiset():
    jobs = list(range(23))
    got = map_in_processes(square, jobs, 2, chunksize=2, ordered=False)
    assert sorted(got) == [x * x for x in jobs]


def test_worker_count_is_at_least_one_and_capped_by_default():
    assert worker_count(0) == 1
    assert worker_count(5) == 5
    assert 1 <= worker_count(None) <= 16
