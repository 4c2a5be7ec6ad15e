"""``ardit`` / ``python -m ardit_cli``: generate images and list the served models from a terminal.

The knob options of ``generate`` (``--num-inference-steps``, ``--text-guidance-scale``, ...) are not written down
here: they are made at run time from the served model's own knob table (ListModels over gRPC, ``GET /v1/models``
over REST), so ``ardit generate --help`` asks the server first, and says so when it cannot reach it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ardit_cli.models import KnobSpec, ModelCard
from ardit_cli.request import CLIError, ImageRequest

DEFAULT_URL = "http://127.0.0.1:8000"
FORMAT_OF_SUFFIX = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def _connection_options(parser: argparse.ArgumentParser, inherited: bool = False) -> None:
    """The connection options; ``inherited``: a subcommand's copy, which leaves values given before it alone."""
    group = parser.add_argument_group("connection")
    url = os.environ.get("ARDIT_URL", DEFAULT_URL)

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if inherited else value

    group.add_argument("--url", default=default(url),
                       help=f"the gateway's base URL, for the REST API (default: $ARDIT_URL or {DEFAULT_URL})")
    group.add_argument("--grpc", metavar="ADDRESS", default=default(os.environ.get("ARDIT_GRPC") or None),
                       help="talk gRPC to ar_service at HOST:PORT instead of REST to the gateway (default: $ARDIT_GRPC)")
    group.add_argument("--api-key", default=default(os.environ.get("ARDIT_API_KEY") or None),
                       help="the gateway's API key (default: $ARDIT_API_KEY; REST only)")
    group.add_argument("--timeout", type=float, default=default(600.0), help="seconds to wait for the images (default: 600)")
    group.add_argument("--tls-ca", type=Path, default=default(None), help="gRPC over TLS: the CA that signed ar_service's certificate")
    group.add_argument("--tls-cert", type=Path, default=default(None), help="gRPC mutual TLS: the client certificate")
    group.add_argument("--tls-key", type=Path, default=default(None), help="gRPC mutual TLS: the client certificate's key")


def _client(args: argparse.Namespace) -> Any:
    if args.grpc:
        from ardit_cli.grpc_client import GrpcClient
        from servicekit.tls import TLSConfigError

        try:
            return GrpcClient(args.grpc, args.timeout, args.tls_ca, args.tls_cert, args.tls_key)
        except TLSConfigError as exc:
            raise CLIError(str(exc)) from None
    from ardit_cli.rest import RestClient

    return RestClient(args.url, args.api_key, args.timeout)


def _where(args: argparse.Namespace) -> str:
    return f"ar_service at {args.grpc} (gRPC)" if args.grpc else f"the gateway at {args.url}"


# -- the parsers ---------------------------------------------------------------------------------


def _parser(
    card: ModelCard | None, unreachable: str | None
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The whole command line, and its ``generate`` and ``edit`` parts (knob options from ``card``, when fetched)."""
    parser = argparse.ArgumentParser(prog="ardit", description="Generate images with an ardit server.", allow_abbrev=False)
    _connection_options(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = commands.add_parser("models", help="list the served models and their knobs", allow_abbrev=False,
                                 description="List the served models: sizes, knobs (type, default, range) and quality presets.")
    _connection_options(models, inherited=True)

    epilog = None
    if card is None:
        epilog = ("The model's knob options (--num-inference-steps, --text-guidance-scale, ...) come from the server's "
                  f"knob table, which could not be fetched: {unreachable}. Start the services, or point --url / --grpc "
                  "at them, then ask again.")
    generate = commands.add_parser(
        "generate", help="generate images from a prompt", allow_abbrev=False, epilog=epilog,
        description="Generate images and write them to files, with progress bars for the AR's grid rows and the "
                    "denoising steps (over gRPC, or REST when the gateway streams).",
    )
    generate.add_argument("prompt", help="what to draw")
    _image_options(generate, card, size_auto="the model's default")
    edit = commands.add_parser(
        "edit", help="edit images from an instruction", allow_abbrev=False, epilog=epilog,
        description="Edit input images as an instruction says (a model that edits: MammothModa2-Dev) and write the "
                    "results to files, with progress bars (over gRPC, or REST through the gateway's /v1/images/edits).",
    )
    edit.add_argument("prompt", help="the edit instruction")
    edit.add_argument("-i", "--image", dest="images", type=Path, action="append", required=True, metavar="FILE",
                      help="an input image (PNG, JPEG or WebP); repeat for several, at most 5: the output takes the "
                           "last one's size unless --size says otherwise")
    _image_options(edit, card, size_auto="the last input image's size")
    return parser, {"generate": generate, "edit": edit}


def _image_options(generate: argparse.ArgumentParser, card: ModelCard | None, size_auto: str) -> None:
    """The options ``generate`` and ``edit`` share: output, size, count, model, quality, format, knobs."""
    generate.add_argument("-o", "--output", type=Path, default=Path("image.png"),
                          help="file to write (default: %(default)s); with -n > 1, IMAGE-0.png, IMAGE-1.png, ...")
    size_help = f"WIDTHxHEIGHT in pixels, or auto ({size_auto})"
    if card is not None and size_auto == "the model's default":
        size_help += (f": {card.default_size} for {card.id}; sides multiples of {card.size_multiple}, "
                      f"at most {card.max_side}")
    generate.add_argument("--size", default="auto", help=size_help)
    generate.add_argument("-n", type=int, default=1, help="number of images, 1-10; image i uses seed + i (default: 1)")
    generate.add_argument("--negative-prompt", metavar="TEXT", help="what to steer away from (with guidance)")
    generate.add_argument("--model", help="the model to use (default: the served one)")
    presets = sorted(card.quality_steps.items(), key=lambda item: (item[1], item[0])) if card else []
    generate.add_argument(
        "--quality", default="auto", choices=["auto", *(q for q, _ in presets)] if card else None,
        help="a preset of denoising steps" + (": " + ", ".join(f"{q} {s}" for q, s in presets) if card else "")
             + " (default: auto, the model's default)",
    )
    generate.add_argument("--output-format", choices=sorted(set(FORMAT_OF_SUFFIX.values())),
                          help="the images' encoding (default: from the output's suffix, else png)")
    generate.add_argument("--output-compression", type=int, metavar="0-100", help="jpeg and webp only")
    generate.add_argument("--partial-images", type=int, default=0, metavar="N",
                          help="also write N (0-3) partial images per image as the denoise goes, IMAGE.partialK.png, "
                               "where the server makes them (gRPC, or a streaming gateway)")
    generate.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    if card is not None:
        knobs = generate.add_argument_group(
            f"knobs of {card.id} ({card.kind}), from the server's table",
            "Left out, a knob keeps the default shown (the server fills it in).",
        )
        for knob in card.knobs:
            _knob_option(knobs, knob)
    _connection_options(generate, inherited=True)


def _knob_option(group: Any, knob: KnobSpec) -> None:
    facts = "; ".join(part for part in (f"default {knob.default_text()}", knob.range_text()) if part)
    help_text = f"{knob.description} [{facts}]".replace("%", "%%")
    dest = f"knob__{knob.name}"
    if knob.type == "float_pair":
        group.add_argument(knob.option, dest=dest, type=float, nargs=2, metavar=("START", "END"), help=help_text)
    elif knob.type == "string":
        group.add_argument(knob.option, dest=dest, choices=knob.choices or None, help=help_text)
    else:
        group.add_argument(knob.option, dest=dest, type=int if knob.type == "int" else float,
                           metavar="N" if knob.type == "int" else "X", help=help_text)


def _pick(cards: list[ModelCard], model: str | None) -> ModelCard:
    if not cards:
        raise CLIError("the server serves no model")
    if model is None:
        return cards[0]
    for card in cards:
        if card.id == model:
            return card
    raise CLIError(f"model {model!r} is not served; served: {', '.join(card.id for card in cards)}")


# -- commands ------------------------------------------------------------------------------------


def _generate(args: argparse.Namespace, card: ModelCard, client: Any) -> int:
    from ardit_cli.reporter import ConsoleReporter

    knobs = {name.removeprefix("knob__"): value for name, value in vars(args).items()
             if name.startswith("knob__") and value is not None}
    seed = knobs.pop("seed", None)  # a typed field of the request on both APIs, not a knob on the wire
    output_format = args.output_format or FORMAT_OF_SUFFIX.get(args.output.suffix.lower(), "png")
    request = ImageRequest(
        prompt=args.prompt, size=args.size, n=args.n, seed=seed, negative_prompt=args.negative_prompt, model=args.model,
        quality=args.quality, output_format=output_format, output_compression=args.output_compression,
        partial_images=args.partial_images, knobs={k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()},
    )
    for path in getattr(args, "images", None) or []:
        try:
            request.images.append(path.read_bytes())
        except OSError as exc:
            raise CLIError(f"cannot read the input image {path}: {exc.strerror or exc}") from None
        request.image_names.append(path.name)
    if args.output.parent != Path(""):
        args.output.parent.mkdir(parents=True, exist_ok=True)
    reporter = ConsoleReporter(args.output, args.n, show_progress=args.progress)
    try:
        client.generate(request, reporter)
    finally:
        reporter.close()
    if not reporter.written:
        raise CLIError("the server answered without images")
    if args.partial_images and not reporter.previews:
        print(f"note: {_where(args)} sent no partial images", file=sys.stderr)
    reporter.report(sys.stdout)
    return 0


def _models(cards: list[ModelCard]) -> int:
    for card in cards:
        print(f"{card.id} ({card.kind}): default size {card.default_size}, sides multiples of {card.size_multiple} "
              f"up to {card.max_side}, prompts up to {card.max_prompt_tokens} tokens")
        if card.grid_text():
            print(f"  visual-token grid: {card.grid_text()}")
        presets = sorted(card.quality_steps.items(), key=lambda item: (item[1], item[0]))
        print("  quality presets (denoising steps): " + ", ".join(f"{q} {s}" for q, s in presets))
        print("  knobs (ardit generate OPTION VALUE):")
        width = max((len(knob.option) for knob in card.knobs), default=0)
        for knob in card.knobs:
            limits = f"; {knob.range_text()}" if knob.range_text() else ""
            print(f"    {knob.option:<{width}}  {knob.type}, default {knob.default_text()}{limits}: {knob.description}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # First the connection alone (it may stand anywhere), so that the knob table can be fetched to build the options.
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _connection_options(probe)
    connection, _ = probe.parse_known_args(argv)
    command = next((word for word in argv if word in ("generate", "edit", "models")), None)

    client = None
    cards: list[ModelCard] = []
    card = None
    unreachable = None
    try:
        if command in ("generate", "edit", "models"):
            try:
                client = _client(connection)
                cards = client.models()
            except CLIError as exc:
                unreachable = str(exc)
            if command in ("generate", "edit") and unreachable is None:
                card = _pick(cards, _model_flag(argv))
        parser, image_parsers = _parser(card, unreachable)
        args, unknown = parser.parse_known_args(argv)  # --help prints and exits here
        if unreachable is not None:
            raise CLIError(unreachable)
        if args.command == "models":
            if unknown:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            return _models(cards)
        assert card is not None  # generate / edit: fetched, or ``unreachable`` was raised above
        if unknown:
            accepted = ", ".join(knob.option for knob in card.knobs)
            image_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}; the knobs of {card.id} are: {accepted}")
        return _generate(args, card, client)
    except CLIError as exc:
        print(f"ardit: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ardit: interrupted", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()


def _model_flag(argv: list[str]) -> str | None:
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--model")
    return probe.parse_known_args(argv)[0].model
