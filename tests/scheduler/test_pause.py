"""A paused scheduler (/pause_generation in place) runs no forward step, yet ends aborted
requests at once; continued, the others run to the end."""

from __future__ import annotations

from sluice import Engine
from tests.scheduler.conftest import RawDriver


def test_paused_scheduler_holds_requests_and_ends_aborts(tiny_engine: Engine) -> None:
    sched, drv = tiny_engine.scheduler, RawDriver(tiny_engine)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    steps = sched.num_forward_steps
    sched.set_paused(True)
    try:
        drv.add("kept", [5, 6, 7], **params)
        drv.add("dropped", [8, 9], **params)
        for _ in range(5):
            drv.step()
        assert sched.num_forward_steps == steps and sched.internal_state().paused
        assert sched.internal_state().num_waiting_reqs == 2
        drv.abort("dropped")
        drv.step()
        assert drv.results["dropped"].finish.status_code == 499
        assert drv.results["kept"].finish is None and sched.num_forward_steps == steps
    finally:
        sched.set_paused(False)
    drv.run()
    kept = drv.results["kept"]
    assert len(kept.output_ids) == 4 and kept.finish.type == "length"
    assert sched.num_forward_steps > steps and not sched.internal_state().paused
