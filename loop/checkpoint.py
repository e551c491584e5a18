"""Checkpoints: HF model directory + trainer state (optimizer, scheduler, RNG, data position, counters).

Layout under ``<output_dir>/checkpoints/``: ``rollout_<N>/model/`` (HF safetensors + config + tokenizer, loadable
by transformers), ``rollout_<N>/state.{json,safetensors}`` (what every rank shares: optimizer, scheduler,
counters, the parallel layout ``{"dp", "tp", "pp"}`` it was saved at and, under DP × PP, the ``rank_order``),
``rollout_<N>/rank<r>.{json,safetensors}`` per process (global rank ``r``: its optimizer shard, data position and
RNG states), and ``latest`` naming the newest ``rollout_<N>``. Under TP/PP the model is gathered into the HF
directory (rank 0 writes it) and each process's shard of the fp32 master weights and moments sits in its
``rank<r>`` state: the sharded state, loaded back at the same layout (``saved_layout``) and rank order only. The
state files are ``redline.loop.state_file``'s format:
tensors in safetensors, the rest in JSON, so loading a folder from elsewhere never unpickles anything. Folders
of the older pickle format (``state.pt``) are refused with a message saying so: a pickle can run code when
loaded, and ``torch.load(weights_only=True)`` does not take their numpy RNG states.
"""

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from redline.loop import state_file
from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.trainer.parallel.config import MESH_DIMS

RANK_ORDER = ",".join(MESH_DIMS)  # the mesh's dimensions, outermost first: which rank<r> holds which shard

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, rollout_id: int, model, tokenizer_dir: Path, state: dict, rank_state: dict,
         dp: DataParallel = SINGLE_PROCESS) -> Path:
    """Write checkpoint ``rollout_<rollout_id>`` and point ``latest`` at it; returns its folder. Collective under
    torchrun: rank 0 writes the model (gathered over TP/PP by every rank) and ``state`` (identical on every
    rank), each process its ``rank_state`` and RNG states."""
    folder = Path(root) / f"rollout_{rollout_id}"
    tmp = folder.with_name(folder.name + ".tmp")
    if dp.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dp.barrier()
    state_file.save(tmp / f"rank{dp.process_rank}", {**rank_state, "rng": rng_state()})
    if dp.model_parallel:  # every rank takes part in the TP gathers and PP sends; rank 0 writes
        model.save_pretrained(tmp / "model", write=dp.is_main)
    if dp.is_main:
        if not dp.model_parallel:
            model.save_pretrained(tmp / "model")
        copy_tokenizer(tokenizer_dir, tmp / "model")
        layout = {"dp": dp.world, "tp": dp.state.tp if dp.state else 1, "pp": dp.state.pp if dp.state else 1}
        if layout["pp"] > 1:
            layout["stages"] = dp.state.stage_sizes(model.spec)
        order = {"rank_order": RANK_ORDER} if layout["dp"] > 1 and layout["pp"] > 1 else {}  # else either order
        state_file.save(tmp / "state", {**state, "rollout_id": rollout_id, "layout": layout, **order})
    dp.barrier()
    if dp.is_main:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)  # a crash mid-save leaves the previous checkpoint intact
        (Path(root) / "latest").write_text(folder.name)
    dp.barrier()
    return folder


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def resolve(load: str | Path) -> Path:
    """A checkpoint folder from ``--load``: the folder itself, or a checkpoints root / run folder (its latest)."""
    path = Path(load)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "latest").exists():
            candidate = candidate / (candidate / "latest").read_text().strip()
        if (candidate / "state.pt").exists():
            raise ValueError(f"--load {load}: {candidate} is a checkpoint of the older pickle format (state.pt), "
                             f"which redline no longer loads: unpickling a folder can run code")
        if state_file.paths(candidate / "state")[0].exists():
            return candidate
    raise FileNotFoundError(f"--load {load}: no checkpoint there (expected state.json or a 'latest' file)")


def saved_rollout(folder: Path) -> int:
    """The rollout id a checkpoint folder was saved after (its step in the records is this + 1)."""
    return state_file.load(Path(folder) / "state")["rollout_id"]


def saved_ranks(folder: Path) -> int:
    """How many processes saved a checkpoint folder (one ``rank<r>`` state each)."""
    return len(list(Path(folder).glob("rank*.json")))


def saved_layout(folder: Path) -> dict[str, int]:
    """The ``{"dp", "tp", "pp"}`` layout a checkpoint was saved at (folders from before TP/PP: data-parallel
    only, one ``rank<r>`` state per rank)."""
    return state_file.load(Path(folder) / "state").get("layout") or {"dp": saved_ranks(folder), "tp": 1, "pp": 1}


def saved_rank_order(folder: Path) -> str:
    """How the global ranks of a DP × PP checkpoint (both > 1) map to mesh coordinates, outermost first:
    ``RANK_ORDER``, or ``"pp,dp,tp"`` for folders from before data parallelism went outermost (which recorded
    none). With DP or PP of 1 the two orders are the same."""
    return state_file.load(Path(folder) / "state").get("rank_order", "pp,dp,tp")


def load_state(folder: Path, dp: DataParallel = SINGLE_PROCESS) -> tuple[dict, dict]:
    """``(shared state, this process's state)`` of a checkpoint (``validate.check_load`` has checked it was saved
    at this layout); RNG states (in the process's) are restored by the caller with ``set_rng_state``."""
    return state_file.load(Path(folder) / "state"), state_file.load(Path(folder) / f"rank{dp.process_rank}")
