"""The blank-screen control of the screenshot agent (`configs/screen_tiny.py`): a posttrain command
run with every screen `ScreenEnv` shows drawn blank (white, the screen's size), so the policy keeps
the instruction and its own actions but loses what only the screens show (which item is marked,
where things stand). The RL'd policy's held-out success this way, beside its success with the
screens, says how much of it comes from reading them:

    python tools/screen_blank.py --config configs/screen_tiny.py --config.stage=rlvr \\
        --config.workdir=runs/screen_tiny_s0_blank --config.init_from=runs/screen_tiny_s0/1_rlvr \\
        --config.rl.steps=1

(the figure is step 0's `eval/accuracy` and `eval/accuracy/<kind>`, before the one update the
command makes). The environment's reward and state check are untouched: only the pixels change.
"""

from __future__ import annotations

from PIL import Image

from posttrain import main as posttrain_main
from posttrain.rl.envs import screen_env
from posttrain.rl.envs.draw import WHITE


def blank_render(task, state) -> Image.Image:
    """A white screen of the task's size, whatever the state."""
    return Image.new("RGB", task.size, WHITE)


def blank_screens() -> None:
    """Make `ScreenEnv` (and the demonstrations it shares `render` with) show blank screens."""
    screen_env.render = blank_render


if __name__ == "__main__":
    blank_screens()
    posttrain_main.entry()
