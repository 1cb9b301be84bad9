"""The main job's demo, ``python -m chorus demo`` (``run.py``: :func:`chorus.demo.run.run_demo`, ``main``)."""
