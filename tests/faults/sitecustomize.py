"""Fault injection for tests that run real server processes, the engine's own process included.

With this folder on PYTHONPATH, every Python process imports this module at start-up; it changes
nothing unless SPECSERVE_TEST_FAULTS holds a JSON object, which wraps the engine's target pass:
  "poison": T          a pass that holds a request whose prompt starts with token T raises
  "fatal": T           the same, with the message of a CUDA device error (the engine must die)
  "step_delay": S      every pass sleeps S seconds first (long requests for shutdown tests)
"""
import json
import os

_FAULTS = os.environ.get("SPECSERVE_TEST_FAULTS")

if _FAULTS:
    import time

    import engine.spec_decode.decoder as _engine

    _faults = json.loads(_FAULTS)
    _verify = _engine.verify

    def _starts_with(scheduled, token) -> bool:
        return token is not None and any(item.request.token_ids[0] == token for item in scheduled)

    def _faulty_verify(target, scheduled, proposal, *masks):
        time.sleep(_faults.get("step_delay", 0.0))
        if _starts_with(scheduled, _faults.get("fatal")):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        if _starts_with(scheduled, _faults.get("poison")):
            raise RuntimeError("injected fault")
        return _verify(target, scheduled, proposal, *masks)

    _engine.verify = _faulty_verify
