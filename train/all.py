"""``python -m train.all --out DIR``: VAE, then AR, then DiT, each time-boxed; the checkpoint is written after each."""

from __future__ import annotations

from train.cli import STAGES, parser, run


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__.splitlines()[0], with_stages=False).parse_args(argv)
    run(args, list(STAGES))


if __name__ == "__main__":
    main()
