"""The CUDA caching allocator model against reserved peaks counted by hand, one rule per trace (no torch).

Each expected figure is worked out from the rule it names (c10/cuda/CUDACachingAllocator.cpp, see
planner/models/allocator.py), not read back from the model."""

import pytest

from planner.models.allocator import AllocatorConfig, CachingAllocator, SimulatedOOM, replay

MiB = 1 << 20


def run(steps, config=None):
    sim = CachingAllocator(config)
    for step in steps:
        if step[0] == "a":
            sim.malloc(step[1], step[2])
        elif step[0] == "f":
            sim.free(step[1])
        else:
            sim.empty_cache()
    return sim


def test_every_request_rounds_to_512_bytes_in_a_2_mib_small_segment():
    sim = run([("a", 1, 1), ("a", 2, 513)])
    assert sim.allocated == 512 + 1024
    assert sim.reserved == 2 * MiB


def test_small_requests_pack_into_2_mib_segments():
    sim = run([("a", i, 600 * 1024) for i in range(3)])  # 3 × 600 KiB = 1.76 MiB: one segment
    assert sim.reserved == 2 * MiB
    sim.malloc(9, 600 * 1024)  # no room left: a second segment
    assert sim.reserved == 4 * MiB


def test_requests_of_1_to_10_mib_share_20_mib_segments():
    sim = run([("a", i, 3 * MiB) for i in range(6)])  # 18 MiB in one 20 MiB segment
    assert sim.reserved == 20 * MiB
    sim.malloc(7, 3 * MiB)  # 21 MiB > 20: a second 20 MiB segment
    assert sim.reserved == 40 * MiB


def test_larger_requests_get_a_segment_of_their_size_rounded_to_2_mib():
    sim = run([("a", 1, 11 * MiB + 1)])
    # 12 MiB segment; the 1 MiB − 512 B left is not over 1 MiB, so the block is not split: all 12 allocated
    assert sim.reserved == 12 * MiB and sim.allocated == 12 * MiB
    sim = run([("a", 1, 13 * MiB + 1)])  # 14 MiB segment, 1 MiB − 512 B left: again whole
    sim.malloc(2, 11 * MiB)  # 12 MiB segment
    assert sim.reserved == 26 * MiB


def test_best_fit_reuses_and_splits_cached_blocks():
    sim = run([("a", "A", 40 * MiB), ("a", "B", 30 * MiB), ("f", "A"), ("f", "B"),
               ("a", "C", 30 * MiB),  # B's block exactly
               ("a", "D", 25 * MiB)])  # A's 40 MiB, split: 15 MiB stays cached
    assert sim.reserved == 70 * MiB and sim.allocated == 55 * MiB
    sim.malloc("E", 16 * MiB)  # the 15 MiB remainder is too small: a new segment
    assert sim.reserved == 86 * MiB


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    sim = run([("a", "A", 12 * MiB), ("f", "A"), ("a", "B", 11 * MiB + 512 * 1024)])
    assert sim.allocated == 12 * MiB  # the whole block is handed out (allocated counts block sizes)
    assert sim.reserved == 12 * MiB


def test_freed_neighbours_merge_back_into_the_whole_segment():
    sim = run([("a", i, 5 * MiB) for i in range(3)] + [("f", 1), ("f", 0), ("f", 2)])
    assert sim.reserved == 20 * MiB and sim.allocated == 0
    sim.malloc("big", 20 * MiB)  # the merged 20 MiB block serves it: no new segment
    assert sim.reserved == 20 * MiB


def test_max_split_size_keeps_oversize_blocks_for_large_requests_only():
    cfg = AllocatorConfig.parse("max_split_size_mb:32")
    sim = run([("a", "A", 64 * MiB), ("f", "A"), ("a", "B", 10 * MiB)], cfg)
    assert sim.reserved == 74 * MiB  # the cached 64 MiB block may not serve a request under 32 MiB
    sim.malloc("C", 50 * MiB)  # 64 MiB is within 20 MiB of 50 MiB: used whole, never split
    assert sim.reserved == 74 * MiB and sim.allocated == 74 * MiB
    sim.free("C")
    sim.malloc("D", 40 * MiB)  # 64 ≥ 40 + 20: too far oversize, a new 40 MiB segment
    assert sim.reserved == 114 * MiB


def test_under_a_limit_cached_segments_are_released_before_an_oom():
    cfg = AllocatorConfig(limit_bytes=100 * MiB)
    sim = run([("a", "A", 60 * MiB), ("f", "A"), ("a", "B", 70 * MiB)], cfg)
    assert sim.reserved == 70 * MiB and sim.peak_reserved == 70 * MiB  # 60 released, then 70 mapped
    with pytest.raises(SimulatedOOM):
        sim.malloc("C", 40 * MiB)  # 70 live + 40 > 100 and nothing cached to release
    assert sim.num_ooms == 1


def test_garbage_collection_frees_old_cached_blocks_before_a_new_segment():
    steps = [("a", "A", 30 * MiB), ("a", "B", 30 * MiB), ("f", "A"), ("a", "C", 40 * MiB)]
    without = run(steps, AllocatorConfig(limit_bytes=100 * MiB))
    assert without.peak_reserved == 100 * MiB  # 30 + 30 + 40: the cached 30 stays
    gc = run(steps, AllocatorConfig(limit_bytes=100 * MiB, garbage_collection_threshold=0.5))
    assert gc.peak_reserved == 70 * MiB  # 60 > 50: the cached 30 MiB goes before mapping 40


def test_expandable_segments_grow_by_pages_instead_of_new_segments():
    cfg = AllocatorConfig.parse("expandable_segments:True")
    sim = run([("a", "A", 3 * MiB)], cfg)
    assert sim.reserved == 20 * MiB  # one 20 MiB page of the large pool
    sim.malloc("B", 30 * MiB)  # 17 MiB free at the end + one more page = 37 MiB: no 30 MiB segment
    assert sim.reserved == 40 * MiB
    classic = run([("a", "A", 3 * MiB), ("a", "B", 30 * MiB)])
    assert classic.reserved == 50 * MiB
    sim.free("A")
    sim.free("B")
    sim.empty_cache()  # every page is free again: all unmapped
    assert sim.reserved == 0


def test_empty_cache_releases_only_segments_with_nothing_live():
    sim = run([("a", "A", 3 * MiB), ("a", "B", 40 * MiB), ("a", "C", 4 * MiB), ("f", "B"), ("f", "C"),
               ("empty_cache",)])
    assert sim.reserved == 20 * MiB  # B's segment went; A keeps its 20 MiB segment (split)


def test_replay_resets_peaks_at_each_phase_as_reset_peak_memory_stats_does():
    events = [("a", 1, 40 * MiB), ("a", 2, 40 * MiB), ("f", 2), ("a", 3, 10 * MiB), ("f", 3)]
    phases = replay(events, marks={0: "first", 3: "second"})
    assert phases["first"]["peak_reserved"] == 80 * MiB
    # reserved never shrinks without empty_cache: the second phase starts at 80 MiB
    assert phases["second"]["peak_reserved"] == 80 * MiB
    assert phases["second"]["peak_allocated"] == 50 * MiB


def test_unknown_options_are_refused_not_guessed():
    with pytest.raises(ValueError, match="roundup_power2_divisions"):
        AllocatorConfig.parse("roundup_power2_divisions:4")


def test_a_cuda_memory_history_replays_beside_its_own_segments():
    """The shape torch.cuda.memory._snapshot() gives (device_traces): the model sees allocs and frees; the real
    reserved figure comes from the segment actions of the same trace."""
    from planner.models.allocator import replay_cuda_trace

    trace = [{"action": "segment_alloc", "addr": 0, "size": 20 * MiB, "stream": 0},
             {"action": "alloc", "addr": 0, "size": 3 * MiB, "stream": 0},
             {"action": "alloc", "addr": 3 * MiB, "size": 3 * MiB, "stream": 0},
             {"action": "free_requested", "addr": 0, "size": 3 * MiB, "stream": 0},
             {"action": "free_completed", "addr": 0, "size": 3 * MiB, "stream": 0},
             {"action": "segment_alloc", "addr": 1 << 30, "size": 40 * MiB, "stream": 0},
             {"action": "alloc", "addr": 1 << 30, "size": 40 * MiB, "stream": 0}]
    out = replay_cuda_trace(trace)
    assert out == {"real_peak_reserved": 60 * MiB, "simulated_peak_reserved": 60 * MiB,
                   "simulated_peak_allocated": 43 * MiB}  # 3 live + 40


def test_blas_workspaces_count_two_threads_placed_by_the_allocator_model():
    """One cuBLAS + one cuBLASLt workspace per (handle, stream), and a training step's forward and backward run on two
    threads (two handles). Reserved bytes are the four requests replayed through the caching allocator's model."""
    from planner.models.overheads import describe, workspace_allocated_bytes, workspace_bytes

    MiB = 2**20
    cublas_sm80 = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
    assert workspace_allocated_bytes("9.0") == 2 * (32 * MiB + MiB)
    assert workspace_bytes("9.0") == 2 * 32 * MiB + 2 * MiB  # 32 MiB segments each; both 1 MiB in one 2 MiB segment
    assert workspace_allocated_bytes("8.0") == 2 * (cublas_sm80 + MiB)
    assert workspace_bytes("8.0") == 20 * MiB + 2 * MiB  # two 8.1 MiB requests share one 20 MiB segment
    assert workspace_bytes("9.0", threads=1) == 34 * MiB
    assert workspace_bytes(None, "rocm", "cdna3") == 2 * (128 + 76) * MiB
    assert "66 MiB" in describe("9.0") and "backward" in describe("9.0")
    # Blackwell (B200 10.0, Thor 11.0, RTX 50 12.0) takes Hopper's 32 MiB since pytorch/pytorch#175344 and #189312
    assert workspace_bytes("10.0") == workspace_bytes("12.0") == workspace_bytes("11.0") == workspace_bytes("9.0")
    assert workspace_bytes("8.9") == workspace_bytes("8.0") and workspace_bytes("7.5") == 22 * MiB
