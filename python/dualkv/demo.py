"""The main job: ``python -m dualkv.demo`` (see ``--help``).

For now the attention-level demo (dualkv.demo_attention)."""

from __future__ import annotations

from .demo_attention import main

if __name__ == "__main__":
    main()
