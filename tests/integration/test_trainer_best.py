"""trainer.best: best.json is validated (a bad one is ignored with a reason), improvements are strict and finite."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading

from trainer.best import BEST_FILE, WEIGHTS_FILE, Best, read_best, write_best


class TestReadBest:
    def test_valid_file_round_trips(self, tmp_path) -> None:
        """What the trainer writes, it reads back."""
        import torch

        best = Best(12, 1.25, str(tmp_path / "ckpts" / "step_00000012"))
        write_best(tmp_path, {"w": torch.ones(2)}, best)
        assert read_best(tmp_path) == (best, None)
        assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_FILE, WEIGHTS_FILE]  # no temp files left
        assert (tmp_path / BEST_FILE).read_bytes().endswith(b"}\n")  # `cat best.json` ends its line


class TestWriteBest:
    def test_a_better_model_in_dir_is_never_replaced(self, tmp_path) -> None:
        """Another run sharing DIR wrote a lower val_loss meanwhile: a worse model never goes over it."""
        import torch
        from safetensors.torch import load_file

        good = Best(5, 1.0, "/a/step_00000005")
        assert write_best(tmp_path, {"w": torch.ones(2)}, good) == good
        assert write_best(tmp_path, {"w": torch.zeros(2)}, Best(7, 2.0, "/b/step_00000007")) == good
        assert read_best(tmp_path) == (good, None) and torch.equal(load_file(tmp_path / WEIGHTS_FILE)["w"], torch.ones(2))
        better = Best(9, 0.5, "/b/step_00000009")
        assert write_best(tmp_path, {"w": torch.full((2,), 3.0)}, better) == better

    def test_writers_sharing_dir_take_turns(self, tmp_path) -> None:
        """While another writer holds DIR, nothing is written: weights and best.json always come from one run."""
        import torch

        holder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(holder, fcntl.LOCK_EX)
        writer = threading.Thread(target=write_best, args=(tmp_path, {"w": torch.ones(2)}, Best(1, 1.0, "c")))
        try:
            writer.start()
            writer.join(3)
            waited = writer.is_alive() and not (tmp_path / BEST_FILE).exists()
        finally:
            os.close(holder)
        writer.join(30)
        assert waited and read_best(tmp_path)[0] == Best(1, 1.0, "c")

    def test_leftovers_of_a_killed_writer_are_removed(self, tmp_path) -> None:
        """A write killed midway leaves temporaries as large as the model: the next write removes those named by our
        own patterns (a staging folder of a process that is gone, with safetensors' temporary inside it); another
        program's `.tmpAb12Cd` beside them, or a `.best.json.backup.tmp`, is not ours and stays."""
        import torch

        done = subprocess.Popen(["true"])
        done.wait()
        stage = tmp_path / f".{WEIGHTS_FILE}.export-{done.pid}-0badf00d.tmp"
        stage.mkdir()
        for name in (WEIGHTS_FILE, ".tmpXy12Zw"):
            (stage / name).write_bytes(b"x")
        ours = [f".{WEIGHTS_FILE}.0badf00d.tmp", f".{BEST_FILE}.12345678.tmp"]
        theirs = ["notes.txt", ".tmp-keep.txt", ".tmpAb12Cd", f".{BEST_FILE}.backup.tmp"]
        for name in [*ours, *theirs]:
            (tmp_path / name).write_bytes(b"x")
        write_best(tmp_path, {"w": torch.ones(2)}, Best(1, 1.0, "c"))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*theirs, BEST_FILE, WEIGHTS_FILE])

    def test_a_failed_write_is_an_oserror_and_keeps_the_best(self, tmp_path) -> None:
        """A full disk (here a file size limit) fails with OSError, which the trainer logs and trains on; DIR keeps
        the previous best and no temporary."""
        import torch

        write_best(tmp_path, {"w": torch.ones(2)}, Best(1, 1.0, "c"))
        script = (
            "import resource, signal, sys, torch\n"
            "from trainer.best import Best, write_best\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))\n"
            "try:\n"
            "    write_best(sys.argv[1], {'w': torch.ones(100_000)}, Best(2, 0.5, 'd'))\n"
            "except OSError as exc:\n"
            "    sys.exit(7)\n"
        )
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 7, proc.stderr[-2000:]
        assert read_best(tmp_path) == (Best(1, 1.0, "c"), None)
        assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_FILE, WEIGHTS_FILE]
