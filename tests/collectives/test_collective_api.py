"""The collective API's own rules: op names, errors, object transfer failures, group ownership."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from accord.collectives import ReduceOp, SingleDeviceCollective, TorchCollective
from accord.errors import CollectiveError, CollectiveNotSetupError, ConfigurationError
from accord.testing import run_distributed


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("SUM", ReduceOp.SUM),
        ("avg", ReduceOp.MEAN),
        ("Mean", ReduceOp.MEAN),
        ("prod", ReduceOp.PRODUCT),
        (dist.ReduceOp.MAX, ReduceOp.MAX),
        (ReduceOp.MIN, ReduceOp.MIN),
    ],
)
def test_reduce_op_names(name: object, op: ReduceOp) -> None:
    assert ReduceOp.parse(name) is op


def test_unknown_op_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'sum'.*'mean'.*'avg'"):
        ReduceOp.parse("median")


def test_ops_before_setup_raise_a_clear_error() -> None:
    with pytest.raises(CollectiveNotSetupError, match=r"setup\(\)"):
        TorchCollective("gloo").all_reduce(torch.ones(1))
    collective = SingleDeviceCollective().setup().teardown()
    with pytest.raises(CollectiveNotSetupError):
        collective.barrier()


def test_bad_arguments_say_what_to_do() -> None:
    c = SingleDeviceCollective().setup()
    with pytest.raises(TypeError, match="broadcast_object"):
        c.broadcast([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"src=1 is not a rank"):
        c.broadcast(torch.ones(1), src=1)
    with pytest.raises(ValueError, match="out= must have shape"):
        c.all_reduce(torch.ones(2), out=torch.empty(3))
    with pytest.raises(ValueError, match=r"out= must have shape.*float32"):
        c.all_reduce(
            torch.ones(2, dtype=torch.int64), "mean", out=torch.empty(2, dtype=torch.int64)
        )
    with pytest.raises(ConfigurationError, match=r"Unknown torch.distributed backend"):
        TorchCollective("glooo")
    with pytest.raises(ValueError, match="timeout must be positive"):
        TorchCollective("gloo", timeout=0)


def test_bool_reductions_on_one_rank() -> None:
    c = SingleDeviceCollective().setup()
    flags = torch.tensor([True, False])
    assert c.all_reduce(flags, "sum").dtype == torch.int64
    assert c.all_reduce(flags, "max").tolist() == [True, False]
    assert c.all_reduce(flags, "mean").tolist() == [1.0, 0.0]


def _only_rank_one_unpicklable(rank: int, world_size: int) -> str:
    c = TorchCollective("gloo").setup()
    try:
        c.all_gather_object((lambda: None) if rank == 1 else "fine")
    except TypeError:
        return "TypeError"
    except CollectiveError as err:
        return f"CollectiveError: {err}"
    finally:
        c.teardown()
    return "no error"


def test_other_ranks_learn_which_rank_could_not_pickle() -> None:
    results = run_distributed(_only_rank_one_unpicklable, 2, timeout=60)
    assert results[1] == "TypeError"
    assert results[0].startswith("CollectiveError") and "[1]" in results[0]


def _joins_user_group(rank: int, world_size: int) -> tuple[bool, bool, float]:
    dist.init_process_group("gloo")
    c = TorchCollective().setup()
    total = c.all_reduce(torch.ones(1)).item()
    c.teardown()
    still_up = dist.is_initialized()
    dist.destroy_process_group()
    return c.created_group, still_up, total


def test_joining_a_users_group_leaves_it_up() -> None:
    for created, still_up, total in run_distributed(_joins_user_group, 2, timeout=60):
        assert (created, still_up, total) == (False, True, 2.0)


def _subgroup(rank: int, world_size: int) -> float | None:
    c = TorchCollective("gloo").setup()
    sub = c.new_subgroup([0, 2])
    value = None if sub is None else sub.all_reduce(torch.tensor([float(rank)])).item()
    if sub is not None:
        sub.teardown()
    c.barrier()
    c.teardown()
    return value


def test_subgroup_reduces_over_its_members_only() -> None:
    assert run_distributed(_subgroup, 3, timeout=60) == [2.0, None, 2.0]


def test_multi_rank_setup_without_a_port_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigurationError, match="MASTER_PORT"):
        TorchCollective("gloo").setup(rank=0, world_size=2)


def _through_torch_function_mode(rank: int, world_size: int) -> tuple[list[str], float, float]:
    import pickle

    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    c = TorchCollective("gloo").setup()
    try:
        plain = c.all_reduce(torch.ones(3)).sum().item()  # called on the group directly
        with Watch():
            watched = c.all_reduce(torch.ones(3)).sum().item()
            c.all_gather(torch.ones(2))
        copy = pickle.loads(pickle.dumps(c))  # the group itself is not copied
        assert copy.world_size == world_size
    finally:
        c.teardown()
    return [name for name in seen if name.startswith("all_")], plain, watched


def test_a_torch_function_mode_sees_the_torch_distributed_calls() -> None:
    """accord calls the process group directly where torch.distributed's function would
    only forward to it; under a TorchFunctionMode it goes through the function, as a
    user's own code would, so the mode sees every collective."""
    for seen, plain, watched in run_distributed(_through_torch_function_mode, 2, timeout=60):
        assert "all_reduce" in seen
        assert any(name.startswith("all_gather") for name in seen)
        assert plain == watched == 6.0
