"""GIFs of evaluation episodes (--capture-video), and of a finished run's policy
(scripts/evaluate.py --gif). The episode is played and recorded inside the jit
(evaluation.record_video_episode); here it is drawn on the host: MinAtar channels as coloured
cells, CartPole and Acrobot as line drawings of their state."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from .errors import ConfigError

GIF_FRAME_MS = 60
MINATAR_CELL_PX = 20
# One colour per MinAtar channel (cycled when an env has more channels); empty cells are black.
CHANNEL_COLOURS = [
    (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
    (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
]


def minatar_image(frame) -> Any:
    from PIL import Image

    frame = np.asarray(frame) > 0.5  # (H, W, C) boolean channels
    image = np.zeros((*frame.shape[:2], 3), np.uint8)
    for channel in range(frame.shape[-1]):  # later channels paint over earlier ones
        image[frame[..., channel]] = CHANNEL_COLOURS[channel % len(CHANNEL_COLOURS)]
    image = image.repeat(MINATAR_CELL_PX, axis=0).repeat(MINATAR_CELL_PX, axis=1)
    return Image.fromarray(image)


def cartpole_image(state, env_params) -> Any:
    from PIL import Image, ImageDraw

    width, height, scale = 480, 240, 480 / (2 * 2.4 * 1.2)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    ground = 170
    draw.line([(0, ground), (width, ground)], fill="black")
    cart_x = width / 2 + float(state.x) * scale
    draw.rectangle([cart_x - 25, ground - 15, cart_x + 25, ground + 15], fill=(60, 60, 60))
    pole = 2 * float(env_params.length) * scale
    theta = float(state.theta)
    draw.line([(cart_x, ground - 15), (cart_x + pole * math.sin(theta), ground - 15 - pole * math.cos(theta))],
              fill=(200, 120, 60), width=8)
    return image


def acrobot_image(state, env_params) -> Any:
    from PIL import Image, ImageDraw

    size = 300
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    scale = size / 2 / 2.2
    origin = (size / 2, size / 2)
    angle1, angle2 = float(state.joint_angle1), float(state.joint_angle2)
    # Angles are measured from straight down; y grows downwards in the image.
    joint = (origin[0] + scale * math.sin(angle1), origin[1] + scale * math.cos(angle1))
    tip = (joint[0] + scale * math.sin(angle1 + angle2), joint[1] + scale * math.cos(angle1 + angle2))
    draw.line([(0, origin[1] - scale), (size, origin[1] - scale)], fill="black")  # the goal height
    draw.line([origin, joint], fill=(0, 100, 200), width=8)
    draw.line([joint, tip], fill=(0, 100, 200), width=8)
    for point in (origin, joint):
        draw.ellipse([point[0] - 5, point[1] - 5, point[0] + 5, point[1] + 5], fill=(200, 200, 0))
    return image


def frame_renderer(env_id: str, env_params: Any) -> Callable | None:
    """A function (env_state, frame) -> PIL image, or None when we cannot draw this env."""
    if env_id.endswith("-MinAtar"):
        return lambda state, frame: minatar_image(frame)
    if env_id == "CartPole-v1":
        return lambda state, frame: cartpole_image(state, env_params)
    if env_id == "Acrobot-v1":
        return lambda state, frame: acrobot_image(state, env_params)
    return None


def write_gif(path: Path, states: Any, frames: Any, done: Any, render: Callable) -> int:
    """One environment's states and frames (T, ...) up to and including its first done. Returns
    the number of steps shown: Pillow merges identical consecutive frames into one shown longer,
    so the GIF lasts that many GIF_FRAME_MS."""
    done = np.asarray(done)
    length = int(np.argmax(done)) + 1 if done.any() else done.shape[0]
    images = [render(jax.tree.map(lambda x: x[t], states), frames[t]) for t in range(length)]
    images = to_one_palette(images)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=GIF_FRAME_MS, loop=0)
    return length


def to_one_palette(images: list[Any]) -> list[Any]:
    """RGB images -> palette images sharing one palette of every colour they use (our drawings
    use a handful; beyond GIF's 256, the first 256). Pillow would otherwise build a palette for
    each frame: 30 times slower (15 s for a 500-step CartPole episode on a 2-core VM)."""
    from PIL import Image

    colours = sorted({colour for image in images for _, colour in image.getcolors(maxcolors=256) or []})[:256]
    if not colours:  # a frame of more than 256 colours: one adaptive palette, from the first frame
        palette = images[0].quantize(colors=256)
    else:
        palette = Image.new("P", (1, 1))
        palette.putpalette([channel for colour in colours for channel in colour])
    return [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]


class VideoRecorder:
    """Host side of the video callback (--capture-video): draws the steps recorded inside the jit
    (evaluation.record_video_episode) into RUN_DIR/videos/cycle-<n>.gif, and has the logger send it to
    wandb. No JAX computation runs here: one started from inside a callback could wait for the
    very program that waits for the callback. It runs on the session's host queue
    (logs.HostQueue), so training goes on while a GIF is drawn; a failed write is a warning."""

    def __init__(self, render: Callable, run_dir: Path, logger: Any):
        self.render = render
        self.video_dir = run_dir / "videos"
        self.logger = logger
        self.last_cycle = -1

    def __call__(self, cycle: Any, states: Any, frames: Any, done: Any) -> None:
        if jax.process_index() != 0 or int(cycle) <= self.last_cycle:  # one writer; each cycle once
            return
        self.last_cycle = int(cycle)
        path = self.video_dir / f"cycle-{self.last_cycle}.gif"
        try:
            write_gif(path, jax.tree.map(np.asarray, states), np.asarray(frames), np.asarray(done), self.render)
        except OSError as error:
            print(f"warning: --capture-video: cannot write {path} ({error}); training goes on", file=sys.stderr)
            return
        self.logger.log_video(path, self.last_cycle)


def make_video_recorder(args: Any, env_params: Any, run_dir: Path, logger: Any) -> VideoRecorder | None:
    """The video callback with --capture-video, else None; also None, with one warning line, for
    an env we cannot draw."""
    if not args.capture_video:
        return None
    try:
        import PIL  # noqa: F401  (the GIFs are drawn with Pillow)
    except ImportError:
        raise ConfigError("--capture-video needs Pillow: pip install pillow") from None
    render = frame_renderer(args.env_id, env_params)
    if render is None:
        print(f"warning: --capture-video: cannot draw {args.env_id} (supported: *-MinAtar, CartPole-v1, Acrobot-v1); "
              "training goes on without videos", file=sys.stderr)
        return None
    return VideoRecorder(render, run_dir, logger)
