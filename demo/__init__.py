"""The main job's demo, ``chorus demo`` (``run.py``: :func:`chorus.demo.run.run_demo`, ``main``)."""
