"""Records every function of the project's code called with the traced temperature or
its immediate holder (a dataclass field, a protobuf field, a pydantic field or a dict key
named `temperature` equal to it) among its arguments (test_temperature_path)."""

import os
import sys
import threading

_VALUE = os.environ.get("SPECDEC_TRACE_TEMPERATURE")
_OUT = os.environ.get("SPECDEC_TRACE_OUT")
_ROOTS = tuple(p for p in os.environ.get("SPECDEC_TRACE_ROOTS", "").split(os.pathsep) if p)

if _VALUE and _OUT and _ROOTS:
    value = float(_VALUE)
    seen: set[str] = set()

    def _holds(x) -> bool:
        if type(x) is float:
            return x == value
        if isinstance(x, dict):
            return x.get("temperature") == value
        cls = type(x)
        named = (
            "temperature" in getattr(cls, "__dataclass_fields__", ())
            or "temperature" in getattr(cls, "model_fields", ())
            or (
                hasattr(cls, "DESCRIPTOR")
                and "temperature" in getattr(cls.DESCRIPTOR, "fields_by_name", ())
            )
        )
        return named and getattr(x, "temperature", None) == value

    def _profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(_ROOTS):
            return
        n = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:n]
        local = frame.f_locals
        if any(_holds(local.get(name)) for name in names):
            key = f"{frame.f_globals.get('__name__')}:{code.co_qualname}"
            if key not in seen:
                seen.add(key)
                with open(_OUT, "a") as f:
                    f.write(key + "\n")

    sys.setprofile(_profile)
    threading.setprofile(_profile)
