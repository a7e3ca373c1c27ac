"""The words of `shoal deploy` / `shoal rebalance` for a plan and its result, from plain data."""

from coordinator.ops.migration_executor import Execution
from coordinator.ops.ops_report import migration_report
from coordinator.ops.rebalancer import Report, describe
from engine.migration import MigrationPlan, Step
from engine.rebalance_plan import Proposal


def report(steps: tuple[Step, ...], *, blocked: bool = True,
           execution: Execution | None = None) -> Report:
    plan = MigrationPlan(steps, blocked={(1, 0): "no worker has room"} if blocked else {})
    target = {(0, 0): ("a", "b"), (0, 1): ("b",)}
    proposal = Proposal(target, plan, imbalance_now=1.5, imbalance_after=1.1, resumed=False)
    return Report("rebalance", ["a", "b"], proposal, sizes={}, state={}, execution=execution)


def test_a_plan_is_told_worker_by_worker_with_what_is_left_as_is():
    steps = (Step("copy", (0, 0), "b", source="a", bytes=3 << 20),
             Step("verify", (0, 0), "b"), Step("delete", (0, 1), "a"))
    lines = describe(report(steps))
    assert lines[0] == "rebalance over 2 workers (a, b)"
    assert "copies 1 (3.0 MiB), keeps 0, drops 1; 3 steps" in lines[1]
    assert any(line.split()[:2] == ["b", "+1"] and line.endswith("-> 2 experts") for line in lines)
    assert any("1.50 now, 1.10 after; 1 experts with replicas" in line for line in lines)
    assert any("left as is: expert 1/0: no worker has room" in line for line in lines)
    assert describe(report(steps), steps=1)[-1] == "    ... and 2 more steps"


def test_nothing_to_do_says_why():
    lines = describe(report((), blocked=False))
    assert lines[1] == ("nothing to do: no placement found lowers the predicted imbalance "
                        "enough for the bytes it copies (by 2%, and 1% more for each 3% of "
                        "the experts' bytes copied)")


def test_a_run_says_what_it_sent():
    done = Execution(steps_done=3, copied_bytes=2 << 20, seconds=2.0)
    lines = describe(report((Step("copy", (0, 0), "b", source="a", bytes=2 << 20),),
                            execution=done))
    assert lines[-1] == "done: 3 steps in 2.0 s, sent 2.0 MiB (1.0 MiB/s)"


def test_the_json_names_every_step_and_the_target():
    steps = (Step("copy", (0, 0), "b", source="a", bytes=7),)
    out = migration_report(report(steps, execution=Execution(steps_done=1, counts={"copy": 1})))
    assert out["steps"] == [{"kind": "copy", "layer": 0, "expert": 0, "worker": "b",
                             "source": "a", "bytes": 7}]
    assert out["blocked"] == {"1/0": "no worker has room"}
    assert out["target"] == {"0/0": ["a", "b"], "0/1": ["b"]}
    assert out["execution"]["by_kind"] == {"copy": 1} and out["imbalance_now"] == 1.5
