"""Per-image CPU of the server's train pipeline (RandomResizedCrop + flip), by what each epoch decodes.

    python benchmarks/first_epoch_decode.py [--data DIR] [--images N] [--upscale F] [--repeats R]

Three ways to decode the same crops of the same files, in one process, alternated:
* whole: the file decoded whole at the crop's DCT scale, then cropped (``--region-decode=false``,
  and every first epoch before the region decoder also read the rest of the file);
* region + rest: the crop's region, with the rest of the file entropy-decoded up to EOI, as a
  first epoch decodes a file not yet known to decode (decode.decode_crop(whole=True));
* region only: a file known to decode (later epochs, or `remoteloader pack`ed shards).
It prints CPU ms per image (the best of the repeats) and region-only's share of each: the first
epoch's ceiling against the steady state when decoding is all the server does.
``--upscale 3.33`` re-encodes the photos ~3.3x larger (about 2 MP, quality 90) first.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import cv2
import numpy as np

from remoteloader.server import decode as dec
from remoteloader.server.pipelines import Pipeline, PipelineSpec


def photos(root: pathlib.Path, count: int, upscale: float) -> list[bytes]:
    files = sorted(root.glob("*/*.jpg"))
    files = files[:: max(1, len(files) // count)][:count]
    if upscale == 1:
        return [f.read_bytes() for f in files]
    out = []
    for f in files:
        image = cv2.imread(str(f))
        size = (round(image.shape[1] * upscale), round(image.shape[0] * upscale))
        image = cv2.resize(image, size, interpolation=cv2.INTER_CUBIC)
        image = cv2.add(image, np.random.default_rng(0).integers(0, 6, image.shape, dtype=np.uint8))  # fine texture
        out.append(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data",
        type=pathlib.Path,
        default=pathlib.Path.home() / ".cache/remoteloader-bench/scale-photos",
        help="an ImageFolder of JPEGs (default: the throughput benchmark's cached photos)",
    )
    parser.add_argument("--images", type=int, default=400, help="files to decode (default 400)")
    parser.add_argument("--upscale", type=float, default=1.0, help="re-encode the photos this much larger first")
    parser.add_argument("--repeats", type=int, default=5, help="alternated passes; the best is kept (default 5)")
    parser.add_argument("--size", type=int, default=224, help="output side (default 224)")
    args = parser.parse_args(argv)
    if dec._jpeg is None:
        print("the native region decoder was not built: every decode is whole", file=sys.stderr)
        return 1
    datas = photos(args.data, args.images, args.upscale)
    if not datas:
        parser.error(f"no JPEGs in {args.data}/*/")
    spec = PipelineSpec("train", args.size, args.size)
    modes = {
        "whole": (Pipeline(spec, region_decode=False), False),
        "region + rest": (Pipeline(spec), False),
        "region only": (Pipeline(spec), True),
    }
    for i, data in enumerate(datas[:50]):  # the same pixels, whichever way
        first = [pipeline(data, i, verified=verified) for pipeline, verified in modes.values()]
        assert all(np.array_equal(first[0], other) for other in first[1:]), f"image {i}: pixels differ"
    best: dict[str, float] = {}
    for repeat in range(args.repeats):
        for name, (pipeline, verified) in modes.items():
            started = time.process_time()
            for i, data in enumerate(datas):
                pipeline(data, repeat * len(datas) + i, verified=verified)
            best[name] = min(best.get(name, float("inf")), time.process_time() - started)
    shape = cv2.imdecode(np.frombuffer(datas[0], np.uint8), cv2.IMREAD_REDUCED_COLOR_2).shape
    print(
        f"{len(datas)} JPEGs from {args.data} (first {shape[1] * 2}x{shape[0] * 2} px, mean "
        f"{sum(map(len, datas)) / len(datas) / 1024:.0f} KB), {args.size} px crops, best of {args.repeats}"
    )
    for name, seconds in best.items():
        print(
            f"{name:14s} {1000 * seconds / len(datas):6.2f} CPU ms/img   region only / this "
            f"{best['region only'] / seconds:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
