"""The image-classification demo pipelines under `zephon verify`: decode + random-resized crop +
flip give identical batches at every D, runner and emitter and across stop/resume at another D;
with corrupt JPEGs and on_error='skip' the same records are dropped everywhere. (The long matrix
runs in `make verify`.)"""

from __future__ import annotations

import numpy as np
import pytest

from zephon.cli import main

pytest.importorskip("simplejpeg")


def test_skip_pipeline_is_identical_at_every_d_runner_and_emitter(capsys) -> None:
    assert main(["verify", "zephon.cli:demo_images_skip", "--backends", "numpy,jax,torch", "--degrees", "1,2,4,8",
                 "--runners", "threads:2,processes:2", "--workers", "0", "--processes", "0", "--steps", "4",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "numpy D=2 runner=processes:2" in out and "jax mesh=2x4" in out and "torch D=8" in out
    assert "numpy D=8 @1 -> numpy D=1 @2" in out and "all identical" in out and "DIFFERS" not in out


def test_random_access_pipeline_resumes_across_d(capsys) -> None:
    assert main(["verify", "zephon.cli:demo_images", "--backends", "numpy,torch", "--degrees", "1,2,8",
                 "--runners", "none", "--workers", "0", "--processes", "0", "--steps", "3",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "demo_images:" in out and "all identical" in out and "DIFFERS" not in out


def test_skip_drops_exactly_the_corrupt_records() -> None:
    from zephon.cli.pipelines import demo_images_skip

    p = demo_images_skip()
    loader = p.loader()
    keys = set(np.concatenate([next(loader).data["__key__"] for _ in range(16)]).tolist())
    # 256 rows cover the first pass over the 64 + 128 records: every good one, no corrupt one
    good = {f"tiny-skip-{i:06d}" for i in range(64) if i not in (7, 40)} | {f"tiny-{i:06d}" for i in range(128)}
    assert keys == good
    raising = type(p.transforms[0])(**{**p.transforms[0].__dict__, "on_error": "raise"})
    from zephon import Loader
    with pytest.raises(Exception, match=r"record 7 of source 0 .*field 'jpg'.*on_error='skip'"):
        it = Loader(p.plan, p.sources, [raising])
        for _ in range(8):
            next(it)
