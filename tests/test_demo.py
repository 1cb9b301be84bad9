"""``chorus demo`` (``chorus.demo.run``) on a short request stream, CPU.

The stream: astronaut, cat, astronaut (shifted crop, brighter), coffee, cat (shifted crop,
brighter), rocket (unrelated). Asserted: the first request of each template and the unrelated one
are misses that write an entry; the changed repeats are hits on their template's entry with
similarity >= the threshold; on hits the attention error against dense attention is bounded and
clearly below that of random masks of the same density (the reused mask carries information); the
frames of the hits stay close to a dense run; every request's frames are saved as PNG. A second
test runs the command line with ComfyUI's WanModel when a ComfyUI checkout is found.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chorus.demo import run as demo

SIZE = 192  # 12 x 12 tokens per latent frame, 5 latent frames: 720 tokens, 12 blocks of 64


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_out")
    lines = []
    res = demo.run_demo(num_requests=6, out_dir=str(out), model="diffusers", size=SIZE, frames=17,
                        log=lines.append)
    print("\n".join(lines))
    return res, out, lines


def test_hits_for_similar_requests_and_misses_for_new_or_unrelated(results):
    res, _, _ = results
    assert [(r.name, r.hit) for r in res] == [
        ("astronaut", False), ("cat", False), ("astronaut", True), ("coffee", False), ("cat", True), ("rocket", False)]
    for r in res:
        if r.hit:
            assert r.similarity >= 0.9
            assert r.committed.startswith("hit")
        else:
            assert r.committed.startswith("wrote entry"), r.committed
    assert res[5].similarity < 0.5, "the unrelated request should be far from every entry"


def test_reused_masks_are_sparse_and_close_to_dense(results):
    res, _, _ = results
    for r in (x for x in res if x.hit):
        assert 0.0 < r.density < 0.9, r.density
        # Structured attention, top_p 0.9: about the dropped tenth of the mass comes back as error.
        assert r.attn_err_max < 0.3, r.attn_err_max
        # A random map with the same kept blocks per row does far worse: the reused mask is informed.
        assert r.attn_err_mean < 0.5 * r.random_mask_err, (r.attn_err_mean, r.random_mask_err)
        assert r.psnr_vs_dense > 35.0, r.psnr_vs_dense
    for r in (x for x in res if not x.hit):
        assert r.density is None and r.attn_err_mean is None  # misses run dense attention


def test_frames_are_saved_as_png(results):
    from PIL import Image

    res, out, lines = results
    for r in res:
        files = sorted(os.listdir(r.frame_dir))
        assert files == ["frame_00.png", "frame_01.png", "frame_02.png", "frame_03.png", "frame_04.png"] + (
            ["mask_preview.png"] if r.hit else []) + ["start_image.png"]
        with Image.open(os.path.join(r.frame_dir, "frame_00.png")) as im:
            assert im.size == (SIZE, SIZE) and im.mode == "RGB"
            assert np.asarray(im).std() > 0  # not a blank frame
        assert Path(r.frame_dir).parent == out
    assert any("HIT" in line for line in lines) and any("attention source" in line for line in lines)


def test_bad_options_give_a_clear_error(tmp_path, capsys):
    """Bad settings, a mistyped argument, an --out that is a file and zero layers: exit 2 with one line
    ``error: ...`` on stderr, never a usage block or a traceback."""
    with pytest.raises(ValueError, match="frames"):
        demo.run_demo(num_requests=1, frames=16, log=lambda *_: None)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    small = ["--requests", "1", "--size", "32", "--frames", "1"]
    for args in (["--model", "diffusers", "--size", "100", "--requests", "1"], ["--requests", "x"],
                 ["--out", str(a_file), *small], ["--out", ""], ["--layers", "0", *small]):
        capsys.readouterr()
        assert demo.main(args) == 2, args
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: "), (args, err)


def _comfy_dir() -> Path | None:
    for path in (os.environ.get("COMFYUI_DIR"), "/opt/ComfyUI"):
        if path and (Path(path) / "comfy" / "ldm" / "wan" / "model.py").is_file():
            return Path(path)
    return None


@pytest.mark.host
def test_demo_command_with_comfyui_wanmodel(tmp_path):
    comfy = _comfy_dir()
    if comfy is None:
        pytest.skip("no ComfyUI checkout (set COMFYUI_DIR)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(comfy), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "chorus", "demo", "--model", "comfy", "--requests", "3", "--size", "128",
         "--out", str(tmp_path / "out"), "--no-dense-compare"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ComfyUI WanModel" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line[:3].strip().isdigit()]
    assert [("HIT" in row) for row in rows] == [False, False, True], proc.stdout
    assert len(list((tmp_path / "out").glob("req_*/frame_*.png"))) == 3 * 5
