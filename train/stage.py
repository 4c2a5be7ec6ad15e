"""``python -m train.stage vae|ar|dit ... --out DIR``: the named stages only, continuing from DIR when it exists."""

from __future__ import annotations

from train.cli import parser, run


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__.splitlines()[0], with_stages=True).parse_args(argv)
    run(args, list(args.stages))


if __name__ == "__main__":
    main()
