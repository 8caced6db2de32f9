"""Images and vision-language data: header sizes, decoding, augmentation and packing as lane operators.

Media are bytes fields like any other; everything here is an ordinary operator with an identity
(decoder name and version included, since different decoders give different pixels) and draws
its randomness from the data-derived generator, so the pixels of global batch k are the same at
every D, runner and emitter.
"""

from zephon.media.augment import CenterCrop, Draws, RandomResizedCrop, Resize, normalize
from zephon.media.decode import (
    Decoder,
    ImageDecodeError,
    decode_image,
    decode_region,
    decoder_identity,
    image_format,
)
from zephon.media.libjpeg import add_restart_markers, restart_webdataset
from zephon.media.ops import AugmentImage, DecodeImage, NormalizeImage

__all__ = [
    "AugmentImage", "CenterCrop", "DecodeImage", "Decoder", "Draws", "ImageDecodeError", "NormalizeImage",
    "RandomResizedCrop", "Resize", "add_restart_markers", "decode_image", "decode_region", "decoder_identity",
    "image_format", "normalize", "restart_webdataset",
]
