"""teraio.systems.memory_cap: the two ways a run is held to its emulated capacity, the
ballast's size, and bad modes refused before anything runs."""
import pytest
import torch

from teraio.config import run_config_from_dict
from teraio.systems.capacity import EmulatedCapacity
from teraio.systems.memory_cap import apply_memory_cap, ballast_bytes

GiB = 1 << 30


def test_the_ballast_leaves_the_allocator_the_capacity_in_all():
    # 70 GiB free, 2 GiB already reserved by the allocator: it may add 8 GiB, so 62 GiB are taken
    assert ballast_bytes(10 * GiB, 70 * GiB, 2 * GiB) == 62 * GiB
    # the allocator already holds the capacity: all that is free is taken
    assert ballast_bytes(10 * GiB, 70 * GiB, 10 * GiB) == 70 * GiB
    # the device has less free than the allocator may add: nothing is taken
    assert ballast_bytes(10 * GiB, 5 * GiB, 2 * GiB) == 0
    # the allocator already holds more than the capacity: refused, naming both
    with pytest.raises(ValueError, match=f"holds {12 * GiB} bytes, more than the capacity .*={10 * GiB}"):
        ballast_bytes(10 * GiB, 70 * GiB, 12 * GiB)


def test_a_bad_mode_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"hardware.capacity_mode='ballast'; valid: fraction, reserve"):
        run_config_from_dict({"model": {"name": "tiny"}, "system": {"name": "ideal"},
                              "hardware": {"capacity_mode": "ballast"}})
    with pytest.raises(ValueError, match="valid: fraction, reserve"):  # on the CPU too, before anything
        apply_memory_cap(GiB, torch.device("cpu"), "ballast")


def test_nothing_is_applied_on_the_cpu_or_without_a_capacity():
    for capacity, device in ((GiB, "cpu"), (None, "cuda")):
        held = apply_memory_cap(capacity, torch.device(device), "reserve")
        assert held.mode is None and held.ballast_bytes == 0
        held.lift()  # nothing to give back


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fraction", "reserve"])
def test_the_device_holds_the_capacity_and_no_more_until_lifted(mode):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    capacity = torch.cuda.memory_reserved(device) + 4 * GiB
    with EmulatedCapacity(capacity, device, mode):
        fits = torch.empty(3 * GiB, dtype=torch.uint8, device=device)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GiB, dtype=torch.uint8, device=device)
        del fits
    free_before = torch.cuda.mem_get_info(device)[0]
    more = torch.empty(8 * GiB, dtype=torch.uint8, device=device)  # lifted: the whole device again
    assert torch.cuda.mem_get_info(device)[0] < free_before
    del more
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("mode, retries", [("fraction", 1), ("reserve", 0)])
def test_a_free_block_grows_by_the_pages_it_lacks_only_under_reserve(mode, retries):
    """With expandable segments (the workers' setting), a request larger than the free block
    at the end of the mapped memory: under ``reserve`` the allocator maps the pages it lacks;
    under ``fraction`` it counts the whole request beside the free block, refuses, releases its
    cache (a device sync) and retries (module docstring of ``teraio.systems.memory_cap``)."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    capacity = torch.cuda.memory_reserved(device) + 4 * GiB
    with EmulatedCapacity(capacity, device, mode):
        del_me = torch.empty(2 * GiB, dtype=torch.uint8, device=device)
        del del_me  # 2 GiB free and mapped, unmapped address space after it
        before = torch.cuda.memory_stats(device)["num_alloc_retries"]
        grown = torch.empty(3 * GiB, dtype=torch.uint8, device=device)
        assert torch.cuda.memory_stats(device)["num_alloc_retries"] - before == retries
        del grown
    torch.cuda.empty_cache()
