"""A picture of the paged KV pool, drawn from a real :class:`~jaxpaged.block_manager.BlockManager`.

:class:`BlockPlayground` drives a block manager the way the engine does (admit a
prompt, admit one that shares a system prompt, decode one token for every sequence,
fork a sequence for parallel sampling, finish one) and draws the physical pool as a
grid: one cell per block, coloured by the sequence that owns it, blocks shared by
several sequences (ref > 1) hatched and split between their owners' colours, the
block tables printed beside it.

:func:`show` puts the grid under ipywidgets buttons. Where widgets cannot be used
(``ipywidgets`` missing, no IPython kernel, or ``interactive=False``; the default
follows ``JAXPAGED_NONINTERACTIVE=1``, which the test suite sets) it plays a scripted
sequence of the same actions instead and draws one static frame per action.

Imports no jax; matplotlib and ipywidgets are imported only when drawing, so neither
``import jaxpaged`` nor ``import jaxpaged.viz`` needs them.
"""

from __future__ import annotations

import dataclasses
import os
import random

from jaxpaged.block_manager import NULL_BLOCK, BlockManager

__all__ = ["BlockPlayground", "BlockView", "SCRIPT", "play", "show", "widgets_available"]

# The scripted run of the static fallback: every control at least once.
SCRIPT = ("add", "add_shared", "add_shared", "decode", "decode", "fork", "decode", "finish", "add_shared",
          "decode", "toggle_prefix_caching")


@dataclasses.dataclass(frozen=True)
class BlockView:
    """What the grid shows of one physical block."""

    block_id: int
    ref_cnt: int
    owners: tuple[str, ...]  # sequences whose block table holds it, in admission order
    filled: int  # slots holding a token, the most of any owner
    cached: bool  # registered in the prefix cache (reusable after it is freed)


def _name(i: int) -> str:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return letters[i % 26] + (str(i // 26) if i >= 26 else "")


class BlockPlayground:
    """A ``BlockManager`` and the token streams of the sequences it holds.

    Every action is logged with its tokens, so ``toggle_prefix_caching`` can replay the
    same workload on a fresh manager with prefix caching switched: the two runs differ
    only in what is shared.

    Args:
      num_blocks: blocks in the pool, null block 0 included.
      block_size: token slots per block.
      enable_prefix_caching: start with prefix caching on or off.
      system_prompt_len: tokens of the prompt that ``add(shared_prefix=True)`` requests
        start with; default two and a half blocks (two full blocks can be shared).
      seed: seeds the random prompts and decoded tokens.
    """

    def __init__(self, num_blocks: int = 32, block_size: int = 4, *, enable_prefix_caching: bool = True,
                 system_prompt_len: int | None = None, seed: int = 0):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._rng = random.Random(seed)
        n = system_prompt_len if system_prompt_len is not None else 2 * block_size + block_size // 2
        self.system_prompt = [self._rng.randrange(1, 1000) for _ in range(n)]
        self._log: list[tuple] = []
        self._reset(enable_prefix_caching)

    def _reset(self, enable_prefix_caching: bool) -> None:
        self.bm = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching=enable_prefix_caching,
                               watermark=0.0)
        self.tokens: dict[str, list[int]] = {}  # live sequences, in admission order
        self.colour: dict[str, int] = {}  # colour index of every sequence ever seen
        self.message = f"empty pool of {self.num_blocks - 1} usable blocks of {self.block_size} slots"

    @property
    def enable_prefix_caching(self) -> bool:
        return self.bm.enable_prefix_caching

    @property
    def live(self) -> list[str]:
        return list(self.tokens)

    # ---- actions (each returns a one-line description, also kept in ``message``) -----

    def add(self, shared_prefix: bool = False, prompt_len: int | None = None) -> str:
        """Admit a new prompt: random tokens, or the system prompt plus a random suffix."""
        if shared_prefix:
            n = prompt_len if prompt_len is not None else self._rng.randint(1, self.block_size)
            prompt = self.system_prompt + [self._rng.randrange(1, 1000) for _ in range(n)]
        else:
            n = prompt_len if prompt_len is not None else self._rng.randint(self.block_size, 3 * self.block_size)
            prompt = [self._rng.randrange(1000, 2000) for _ in range(n)]
        name = _name(len(self.colour))
        self._log.append(("add", name, prompt, shared_prefix))
        return self._add(name, prompt, shared_prefix)

    def decode(self) -> str:
        """Every live sequence gets one token: a slot (maybe a copy-on-write), then its K/V."""
        new = {name: self._rng.randrange(2000, 3000) for name in self.tokens}
        self._log.append(("decode", new))
        return self._decode(new)

    def fork(self, name: str | None = None) -> str:
        """A second sample of ``name`` (default: the newest sequence) sharing all its blocks."""
        name = name if name is not None else (self.live[-1] if self.tokens else None)
        child = _name(len(self.colour))
        self._log.append(("fork", name, child))
        return self._fork(name, child)

    def finish(self, name: str | None = None) -> str:
        """Free ``name`` (default: the oldest sequence)."""
        name = name if name is not None else (self.live[0] if self.tokens else None)
        self._log.append(("finish", name))
        return self._finish(name)

    def toggle_prefix_caching(self) -> str:
        """Replay every action so far on a fresh manager with prefix caching switched."""
        self._reset(not self.enable_prefix_caching)
        for op, *args in self._log:
            getattr(self, f"_{op}")(*args)
        on = "on" if self.enable_prefix_caching else "off"
        self.message = f"prefix caching {on}: replayed the same {len(self._log)} actions -> {self.message}"
        return self.message

    def apply(self, action: str) -> str:
        """Run one action by name: ``add``, ``add_shared``, ``decode``, ``fork``, ``finish``,
        ``toggle_prefix_caching``."""
        if action == "add_shared":
            return self.add(shared_prefix=True)
        if action not in ("add", "decode", "fork", "finish", "toggle_prefix_caching"):
            raise ValueError(f"unknown action {action!r}")
        return getattr(self, action)()

    def _say(self, message: str) -> str:
        self.message = message
        return message

    def _add(self, name: str, prompt: list[int], shared_prefix: bool) -> str:
        self.colour.setdefault(name, len(self.colour))
        kind = "with the shared system prompt" if shared_prefix else "random"
        if not self.bm.can_allocate(prompt):
            return self._say(f"pool full: cannot admit {name} ({len(prompt)} tokens, {kind})")
        num_cached = self.bm.allocate(name, prompt)
        # The prefill step writes the prompt's K/V; its full blocks then enter the prefix cache.
        self.bm.mark_computed(name, len(prompt), prompt)
        self.tokens[name] = list(prompt)
        hit = f"; {num_cached} tokens from the prefix cache" if num_cached else ""
        return self._say(f"add {name}: {len(prompt)} tokens, {kind}, blocks {self.bm.block_table(name)}{hit}")

    def _decode(self, new: dict[str, int]) -> str:
        notes = []
        for name in [n for n in new if n in self.tokens]:
            if not self.bm.can_append_slots(name, 1):
                self.bm.free(name)  # preemption by recompute: the engine would requeue it
                del self.tokens[name]
                notes.append(f"pool full: preempted {name}")
                continue
            for src, dst in self.bm.append_slots(name, 1):
                notes.append(f"copy-on-write for {name}: block {src} -> {dst}")
            self.tokens[name].append(new[name])
            self.bm.mark_computed(name, len(self.tokens[name]), self.tokens[name])
        live = sum(n in self.tokens for n in new)
        return self._say(f"decode: one token for {live} sequence(s)" + "".join(f"; {n}" for n in notes))

    def _fork(self, name: str | None, child: str) -> str:
        self.colour.setdefault(child, len(self.colour))
        if name not in self.tokens:
            return self._say("fork: no sequence to fork")
        self.bm.fork(name, child)
        self.tokens[child] = list(self.tokens[name])
        return self._say(f"fork {name} -> {child}: shares all {len(self.bm.block_table(child))} blocks (ref + 1); "
                         f"the first write into a shared partial block copies it")

    def _finish(self, name: str | None) -> str:
        if name not in self.tokens:
            return self._say("finish: no sequence to finish")
        self.bm.free(name)
        del self.tokens[name]
        return self._say(f"finish {name}: its blocks are freed (full, computed ones stay in the prefix cache)")

    # ---- what is drawn --------------------------------------------------------------

    def blocks(self) -> list[BlockView]:
        """One view per physical block, null block included."""
        owners: dict[int, list[str]] = {}
        filled: dict[int, int] = {}
        bs = self.block_size
        for name in self.tokens:
            n = self.bm.num_tokens(name)
            for i, b in enumerate(self.bm.block_table(name)):
                owners.setdefault(b, []).append(name)
                filled[b] = max(filled.get(b, 0), min(bs, n - i * bs))
        return [BlockView(b.block_id, b.ref_cnt, tuple(owners.get(b.block_id, ())), filled.get(b.block_id, 0),
                          b.block_hash is not None) for b in self.bm.pool.blocks]

    def table_text(self) -> str:
        """The block tables and pool counts as monospaced lines."""
        s = self.bm.stats()
        views = self.blocks()
        lines = [f"prefix caching {'on' if self.enable_prefix_caching else 'off'}", ""]
        for name, toks in self.tokens.items():
            table = self.bm.block_table(name)
            shared = [b for b in table if views[b].ref_cnt > 1]
            lines.append(f"{name}: {table}  {len(toks)} tok" + (f", shares {shared}" if shared else ""))
        if not self.tokens:
            lines.append("(no sequences)")
        lines += ["", f"used {s.num_used_blocks}  cached {s.num_cached_blocks}  free {s.num_free_blocks}",
                  f"shared (ref > 1): {sum(v.ref_cnt > 1 for v in views)}",
                  f"slot utilization {s.utilization:.0%}"]
        return "\n".join(lines)

    def draw(self, title: str | None = None, *, columns: int = 8):
        """A matplotlib figure: the block grid on the left, the block tables on the right."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle

        cmap = plt.get_cmap("tab10")
        views = self.blocks()
        rows = -(-len(views) // columns)
        fig, (ax, ax_text) = plt.subplots(1, 2, figsize=(11, 0.8 * rows + 1.6),
                                          gridspec_kw={"width_ratios": [columns, 5.5]})
        for v in views:
            r, c = divmod(v.block_id, columns)
            x, y = c, rows - 1 - r
            if v.block_id == NULL_BLOCK:
                ax.add_patch(Rectangle((x, y), 0.94, 0.94, color="0.25"))
                ax.text(x + 0.47, y + 0.45, "null", ha="center", va="center", color="white", fontsize=8)
            elif v.owners:
                w = 0.94 / len(v.owners)
                for i, o in enumerate(v.owners):
                    ax.add_patch(Rectangle((x + i * w, y), w, 0.94, color=cmap(self.colour[o] % 10), alpha=0.85))
                if v.ref_cnt > 1:
                    ax.add_patch(Rectangle((x, y), 0.94, 0.94, fill=False, hatch="///", edgecolor="black", lw=1.5))
                label = ",".join(v.owners) if len(v.owners) <= 3 else f"{len(v.owners)} seqs"
                box = dict(facecolor="white", alpha=0.75, pad=1, lw=0) if v.ref_cnt > 1 else None
                ax.text(x + 0.47, y + 0.6, label, ha="center", va="center", fontsize=8, weight="bold", bbox=box)
                ax.text(x + 0.47, y + 0.25, f"{v.filled}/{self.block_size}" + (f" ref {v.ref_cnt}"
                        if v.ref_cnt > 1 else ""), ha="center", va="center", fontsize=7, bbox=box)
            else:
                ax.add_patch(Rectangle((x, y), 0.94, 0.94, facecolor="0.88" if v.cached else "white",
                                       edgecolor="0.6", lw=0.8))
                if v.cached:
                    ax.text(x + 0.47, y + 0.4, "cached", ha="center", va="center", fontsize=7, color="0.3")
            ax.text(x + 0.05, y + 0.86, str(v.block_id), fontsize=6, va="top", color="0.2")
        ax.set_xlim(-0.1, columns)
        ax.set_ylim(-0.1, rows)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch="///", label="shared (ref > 1)"),
                           Patch(facecolor="0.88", edgecolor="0.6", label="free, prefix cached"),
                           Patch(facecolor="white", edgecolor="0.6", label="free")],
                  loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
        ax.set_title(title or "physical KV blocks", fontsize=9, loc="left")
        ax_text.axis("off")
        ax_text.text(0, 1, self.table_text(), family="monospace", fontsize=8, va="top")
        ax_text.text(0, 0, self.message, fontsize=7, va="bottom", wrap=True, color="0.3")
        fig.tight_layout()
        return fig


def widgets_available() -> bool:
    """Whether ipywidgets can be shown: importable, inside an IPython kernel, and not
    switched off with ``JAXPAGED_NONINTERACTIVE=1``."""
    if os.environ.get("JAXPAGED_NONINTERACTIVE", "") not in ("", "0"):
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def play(pg: BlockPlayground, actions=SCRIPT) -> None:
    """Apply ``actions`` one by one, printing each and drawing a static frame after it."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    for i, action in enumerate(actions, 1):
        message = pg.apply(action)
        title = f"frame {i}/{len(actions)}: {action}"
        print(f"{title} -> {message}")
        fig = pg.draw(title)
        display(fig)
        plt.close(fig)


def show(pg: BlockPlayground, *, interactive: bool | None = None):
    """Buttons that drive ``pg`` and redraw its grid; or, without widgets, :func:`play`.

    Args:
      pg: the playground to drive.
      interactive: force widgets on or off; ``None``: :func:`widgets_available`.
    """
    if not (widgets_available() if interactive is None else interactive):
        play(pg)
        return None
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    out = w.Output()
    target = w.Dropdown(description="sequence", layout=w.Layout(width="180px"))

    def redraw(title=None):
        target.options = pg.live
        with out:
            out.clear_output(wait=True)
            fig = pg.draw(title)
            display(fig)
            plt.close(fig)

    def button(label, action):
        b = w.Button(description=label, layout=w.Layout(width="auto"))
        b.on_click(lambda _: (action(), redraw()))
        return b

    buttons = [
        button("add request", lambda: pg.add()),
        button("add with shared prefix", lambda: pg.add(shared_prefix=True)),
        button("decode step", lambda: pg.decode()),
        button("fork (n=2)", lambda: pg.fork(target.value)),
        button("finish", lambda: pg.finish(target.value)),
        button("toggle prefix caching", lambda: pg.toggle_prefix_caching()),
    ]
    ui = w.VBox([w.HBox(buttons), target, out])
    redraw()
    display(ui)
    return ui
