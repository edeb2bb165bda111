"""``cast-llm doctor``: the environment and every checked kernel path's verdict on this machine, timed against
its reference (:mod:`~cast_llm.doctor.report`; the paths themselves: :mod:`cast_llm.kernels`)."""

from cast_llm.doctor.report import doctor, format_doctor

__all__ = ["doctor", "format_doctor"]
