/* Region decode of a JPEG through libjpeg-turbo's libjpeg API, for zephon.media.libjpeg.

Why C: a random-resized crop needs only a box of the image, and libjpeg-turbo can decode just that
box (jpeg_crop_scanline for the columns, jpeg_skip_scanlines for the rows above, stopping after
the box's last row) at a reduced DCT scale. No Python JPEG package exposes that, and the libjpeg
API reports errors by calling error_exit, which must not return: that needs setjmp/longjmp, which
only C can do. So this small module binds the few functions it needs.

Where the library comes from: the libjpeg-turbo that Pillow's wheel bundles (a libjpeg.so.62),
found by zephon.media.libjpeg and passed to load(), which opens it with dlopen. Nothing is linked
at build time, so the module builds without libjpeg headers or libraries beyond the ABI header
vendored beside it (jpeglib.h of the 6.2 ABI). jpeg_CreateDecompress checks the library's ABI
version and struct size against this header's: another ABI raises instead of misbehaving.

Errors: corrupt data, truncation and every libjpeg warning (corrupt-data warnings) raise
ValueError with libjpeg's message; CMYK/YCCK images raise LookupError (Python falls back to
Pillow); a box outside the image raises IndexError (the caller's mistake, not the data's). The GIL is released while decoding, so threads decode in parallel. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include "jpeglib.h"

/* --- the library's functions, found by dlsym ------------------------------------------------ */
#define JFUNCS(X)                  \
  X(jpeg_std_error)                \
  X(jpeg_CreateDecompress)         \
  X(jpeg_destroy_decompress)       \
  X(jpeg_mem_src)                  \
  X(jpeg_read_header)              \
  X(jpeg_calc_output_dimensions)   \
  X(jpeg_start_decompress)         \
  X(jpeg_crop_scanline)            \
  X(jpeg_skip_scanlines)           \
  X(jpeg_read_scanlines)           \
  X(jpeg_abort_decompress)         \
  X(jpeg_finish_decompress)        \
  X(jpeg_save_markers)             \
  X(jpeg_read_coefficients)        \
  X(jpeg_CreateCompress)           \
  X(jpeg_destroy_compress)         \
  X(jpeg_mem_dest)                 \
  X(jpeg_copy_critical_parameters) \
  X(jpeg_write_coefficients)       \
  X(jpeg_write_marker)             \
  X(jpeg_finish_compress)

#define DECLARE(name) static __typeof__(&name) p_##name = NULL;
JFUNCS(DECLARE)

static void *lib_handle = NULL;

/* --- error handling: longjmp back with libjpeg's message ------------------------------------ */
typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
} ErrorMgr;

static void on_error(j_common_ptr cinfo) {
  ErrorMgr *err = (ErrorMgr *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
  if (level < 0) { /* a warning: corrupt data libjpeg would otherwise decode as best it can */
    ErrorMgr *err = (ErrorMgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
  }
}

static void setup(struct jpeg_decompress_struct *cinfo, ErrorMgr *err) {
  cinfo->err = p_jpeg_std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  err->message[0] = 0;
}

static PyObject *not_loaded(void) {
  PyErr_SetString(PyExc_RuntimeError, "zephon.media.libjpeg_binding: load() has not been called");
  return NULL;
}

/* load(path): dlopen libjpeg and check that its ABI is the 6.2 one this module is built for. */
static PyObject *load(PyObject *self, PyObject *args) {
  (void)self;
  const char *path;
  if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
  if (lib_handle != NULL) Py_RETURN_NONE;
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, dlerror());
    return NULL;
  }
#define LOOKUP(name)                                                              \
  p_##name = (__typeof__(&name))dlsym(h, #name);                                 \
  if (p_##name == NULL) {                                                         \
    PyErr_Format(PyExc_OSError, "%s has no %s: not a libjpeg-turbo", path, #name); \
    dlclose(h);                                                                   \
    return NULL;                                                                  \
  }
  JFUNCS(LOOKUP)
  /* The ABI check: a library of another version (libjpeg.so.8) or struct size errors here. */
  struct jpeg_decompress_struct cinfo;
  ErrorMgr err;
  setup(&cinfo, &err);
  if (setjmp(err.jump)) {
    dlclose(h);
    PyErr_Format(PyExc_OSError, "%s: %s", path, err.message);
    return NULL;
  }
  p_jpeg_CreateDecompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  p_jpeg_destroy_decompress(&cinfo);
  lib_handle = h;
  Py_RETURN_NONE;
}

static PyObject *header(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer data;
  if (lib_handle == NULL) return not_loaded();
  if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
  struct jpeg_decompress_struct cinfo;
  ErrorMgr err;
  setup(&cinfo, &err);
  if (setjmp(err.jump)) {
    p_jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_ValueError, err.message);
    return NULL;
  }
  p_jpeg_CreateDecompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  p_jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
  p_jpeg_read_header(&cinfo, TRUE);
  PyObject *out = Py_BuildValue("(IIii)", cinfo.image_height, cinfo.image_width, cinfo.num_components,
                                (int)cinfo.jpeg_color_space);
  p_jpeg_destroy_decompress(&cinfo);
  PyBuffer_Release(&data);
  return out;
}

/* --- restart intervals: decode only the intervals a box touches -----------------------------

A baseline JPEG with restart markers (DRI) is cut into intervals of `interval` MCUs, each
byte-aligned and starting with fresh DC predictions. When the intervals line up with MCU rows
(an interval is a whole number of rows, or divides a row), the MCUs of a box are a rectangle of
whole intervals, and those intervals alone, renumbered, with the frame's size patched, are a
valid JPEG of that rectangle: decoding it costs entropy decoding of the rectangle only, where a
JPEG without restart markers must entropy-decode every row above the box. One MCU of margin on
every side (where the image has one) gives the chroma upsampling the same neighbours as in the
whole image, so the pixels are the same (tests/test_media_libjpeg.py checks it). */
typedef struct {
  size_t sof;       /* offset of the SOF payload */
  size_t data;      /* first byte of entropy-coded data */
  unsigned width, height, interval, mcu_w, mcu_h, per_row, rows;
} Layout;

static int parse_layout(const unsigned char *d, size_t n, Layout *L) {
  size_t p = 2;
  unsigned hmax = 1, vmax = 1, ncomp = 0, precision = 0;
  int sof = 0;
  memset(L, 0, sizeof(*L));
  if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) return 0;
  while (p + 4 <= n) {
    if (d[p] != 0xFF) return 0;
    unsigned char m = d[p + 1];
    if (m == 0xFF) { p++; continue; }
    if (m == 0xD8 || m == 0x01 || (m >= 0xD0 && m <= 0xD7)) { p += 2; continue; }
    if (m == 0xD9) return 0;
    size_t len = ((size_t)d[p + 2] << 8) | d[p + 3];
    if (len < 2 || p + 2 + len > n) return 0;
    const unsigned char *s = d + p + 4;
    if (m == 0xC0 || m == 0xC1) { /* baseline or extended sequential, Huffman */
      if (len < 8) return 0;
      precision = s[0];
      L->height = ((unsigned)s[1] << 8) | s[2];
      L->width = ((unsigned)s[3] << 8) | s[4];
      ncomp = s[5];
      if (ncomp < 1 || len < 8 + 3 * ncomp) return 0;
      for (unsigned i = 0; i < ncomp; i++) {
        unsigned h = s[7 + 3 * i] >> 4, v = s[7 + 3 * i] & 15;
        if (h < 1 || v < 1) return 0;
        if (h > hmax) hmax = h;
        if (v > vmax) vmax = v;
      }
      L->sof = p + 4;
      sof = 1;
    } else if (m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
      return 0; /* progressive, lossless or arithmetic-coded: not cut here */
    } else if (m == 0xDD) {
      if (len < 4) return 0;
      L->interval = ((unsigned)s[0] << 8) | s[1];
    } else if (m == 0xDA) {
      if (!sof || len < 3 || s[0] != ncomp) return 0; /* one interleaved scan of every component */
      L->data = p + 2 + len;
      break;
    }
    p += 2 + len;
  }
  if (!sof || !L->data || !L->interval || precision != 8 || !L->width || !L->height) return 0;
  L->mcu_w = ncomp == 1 ? 8 : 8 * hmax;
  L->mcu_h = ncomp == 1 ? 8 : 8 * vmax;
  L->per_row = (L->width + L->mcu_w - 1) / L->mcu_w;
  L->rows = (L->height + L->mcu_h - 1) / L->mcu_h;
  if (L->interval <= L->per_row ? L->per_row % L->interval : L->interval % L->per_row) return 0;
  return 1;
}

typedef struct {
  unsigned char *buf; /* the JPEG of the rectangle (malloc'd), NULL when the whole image is needed */
  size_t len;
  unsigned oy, ox;    /* the rectangle's origin in the image, pixels */
} Cut;

/* The JPEG of the MCU rectangle holding original pixels [py0, py1) x [px0, px1) plus margins. */
static int cut_rectangle(const unsigned char *d, size_t n, const Layout *L, unsigned py0, unsigned px0,
                         unsigned py1, unsigned px1, Cut *out) {
  unsigned ucols = L->interval <= L->per_row ? L->interval : L->per_row;
  unsigned urows = L->interval <= L->per_row ? 1 : L->interval / L->per_row;
  unsigned ra = py0 / L->mcu_h, rb = (py1 - 1) / L->mcu_h, ca = px0 / L->mcu_w, cb = (px1 - 1) / L->mcu_w;
  ra = ra > 0 ? ra - 1 : 0;
  ca = ca > 0 ? ca - 1 : 0;
  rb = rb + 1 < L->rows ? rb + 1 : L->rows - 1;
  cb = cb + 1 < L->per_row ? cb + 1 : L->per_row - 1;
  ra -= ra % urows;
  ca -= ca % ucols;
  rb = rb - rb % urows + urows - 1;
  if (rb >= L->rows) rb = L->rows - 1;
  cb = cb - cb % ucols + ucols - 1;
  if (ra == 0 && ca == 0 && rb == L->rows - 1 && cb == L->per_row - 1) return 0; /* all of it */
  /* interval k ends at marker ends[k]; it starts after marker k-1 (or at the scan's start) */
  size_t total = ((size_t)L->rows * L->per_row + L->interval - 1) / L->interval;
  size_t last = ((size_t)rb * L->per_row + cb) / L->interval;
  size_t *ends = (size_t *)malloc((last + 1) * sizeof(size_t));
  if (ends == NULL) return 0;
  size_t k = 0, q = L->data;
  while (k <= last && q + 1 < n) {
    const unsigned char *f = (const unsigned char *)memchr(d + q, 0xFF, n - q - 1);
    if (f == NULL) break;
    q = (size_t)(f - d);
    unsigned char b = d[q + 1];
    if (b == 0x00) { q += 2; continue; }
    if (b == 0xFF) { q += 1; continue; }
    if (b >= 0xD0 && b <= 0xD7) {
      if (b != 0xD0 + (k & 7) || k + 1 >= total) break; /* misnumbered or one too many: corrupt */
      ends[k++] = q;
      q += 2;
      continue;
    }
    if (k + 1 == total) ends[k++] = q; /* the marker after the last interval (EOI) */
    break;
  }
  if (k <= last) { free(ends); return 0; } /* not the markers the header promises: decode it all */
  size_t size = L->data + 2;
  unsigned count = 0;
  for (unsigned r = ra; r <= rb; r += urows)
    for (size_t j = ((size_t)r * L->per_row + ca) / L->interval; j <= ((size_t)r * L->per_row + cb) / L->interval; j++) {
      size_t start = j == 0 ? L->data : ends[j - 1] + 2;
      size += ends[j] - start + 2;
      count++;
    }
  unsigned char *buf = (unsigned char *)malloc(size);
  if (buf == NULL) { free(ends); return 0; }
  memcpy(buf, d, L->data);
  unsigned hs = (rb + 1) * L->mcu_h < L->height ? (rb + 1) * L->mcu_h - ra * L->mcu_h : L->height - ra * L->mcu_h;
  unsigned ws = (cb + 1) * L->mcu_w < L->width ? (cb + 1) * L->mcu_w - ca * L->mcu_w : L->width - ca * L->mcu_w;
  buf[L->sof + 1] = (unsigned char)(hs >> 8);
  buf[L->sof + 2] = (unsigned char)hs;
  buf[L->sof + 3] = (unsigned char)(ws >> 8);
  buf[L->sof + 4] = (unsigned char)ws;
  size_t w = L->data;
  unsigned num = 0;
  for (unsigned r = ra; r <= rb; r += urows)
    for (size_t j = ((size_t)r * L->per_row + ca) / L->interval; j <= ((size_t)r * L->per_row + cb) / L->interval; j++) {
      size_t start = j == 0 ? L->data : ends[j - 1] + 2;
      memcpy(buf + w, d + start, ends[j] - start);
      w += ends[j] - start;
      if (++num < count) {
        buf[w++] = 0xFF;
        buf[w++] = (unsigned char)(0xD0 + ((num - 1) & 7));
      }
    }
  buf[w++] = 0xFF;
  buf[w++] = 0xD9;
  free(ends);
  out->buf = buf;
  out->len = w;
  out->oy = ra * L->mcu_h;
  out->ox = ca * L->mcu_w;
  return 1;
}

/* decode(data, scale_num, y0, x0, y1, x1, rgb=True) -> (pixels, rows, x_offset, width, channels)

The image decoded at scale_num/8 (1..16), the box rows y0..y1, columns x0..x1 of it (y1 = 0,
x1 = 0: to the end). The columns come back widened (context, whole iMCUs): the pixels are a
bytearray of rows x width x channels whose column 0 is column x_offset of the scaled image, and
columns x0 - x_offset .. x1 - x_offset of it are the box. channels is 3 (RGB: libjpeg-turbo
converts a grayscale JPEG too), or 1 for a grayscale JPEG with rgb=False. Rows below y1 are
never decoded; with row-aligned restart markers, neither are the intervals above or beside the
box. */
static PyObject *decode(PyObject *self, PyObject *args) {
  Py_buffer data;
  int scale_num;
  unsigned int y0, x0, y1, x1;
  int rgb = 1;
  (void)self;
  if (lib_handle == NULL) return not_loaded();
  if (!PyArg_ParseTuple(args, "y*iIIII|p", &data, &scale_num, &y0, &x0, &y1, &x1, &rgb)) return NULL;
  if (scale_num < 1 || scale_num > 16) {
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "scale_num must be 1..16 (eighths), got %d", scale_num);
    return NULL;
  }
  struct jpeg_decompress_struct cinfo;
  ErrorMgr err;
  PyObject *volatile pixels = NULL;
  PyObject *volatile kind = PyExc_ValueError; /* the exception type an error raises */
  Cut cut = {NULL, 0, 0, 0};
  volatile unsigned char *cutbuf = NULL;
  const unsigned char *src = (const unsigned char *)data.buf;
  size_t srclen = (size_t)data.len;
  unsigned oy = 0, ox = 0;
  setup(&cinfo, &err);
  PyThreadState *volatile ts = PyEval_SaveThread();
  if (setjmp(err.jump)) {
    p_jpeg_destroy_decompress(&cinfo);
    free((void *)cutbuf);
    PyEval_RestoreThread(ts);
    Py_XDECREF(pixels);
    PyBuffer_Release(&data);
    PyErr_SetString(kind, err.message);
    return NULL;
  }
  p_jpeg_CreateDecompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  p_jpeg_mem_src(&cinfo, src, (unsigned long)srclen);
  p_jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    kind = PyExc_LookupError;
    snprintf(err.message, sizeof(err.message), "a CMYK/YCCK JPEG: libjpeg-turbo cannot decode it to RGB");
    longjmp(err.jump, 1);
  }
  cinfo.scale_num = (unsigned int)scale_num;
  cinfo.scale_denom = 8;
  p_jpeg_calc_output_dimensions(&cinfo);
  if (y1 == 0) y1 = cinfo.output_height;
  if (x1 == 0) x1 = cinfo.output_width;
  if (!(y0 < y1 && y1 <= cinfo.output_height && x0 < x1 && x1 <= cinfo.output_width)) {
    kind = PyExc_IndexError;
    snprintf(err.message, sizeof(err.message), "box (%u, %u, %u, %u) is not inside the %ux%u scaled image",
             y0, x0, y1, x1, cinfo.output_height, cinfo.output_width);
    longjmp(err.jump, 1);
  }
  /* The columns asked of libjpeg-turbo: one pixel of context on the left and two iMCUs on the
     right, so the chroma upsampling of the box's edge columns sees the neighbours it sees in the
     whole image; the caller cuts the exact box out. */
  if (x0 > 0 || x1 < cinfo.output_width) {
    unsigned ctx = 2 * (unsigned)cinfo.max_h_samp_factor * (unsigned)scale_num;
    x0 = x0 > 0 ? x0 - 1 : 0;
    x1 = x1 + ctx < cinfo.output_width ? x1 + ctx : cinfo.output_width;
  }
  Layout L;
  if (cinfo.restart_interval && parse_layout(src, srclen, &L) && L.mcu_w * scale_num % 8 == 0 &&
      L.mcu_h * scale_num % 8 == 0) {
    /* the box in original pixels, rounded outwards */
    unsigned py0 = y0 * 8 / scale_num, px0 = x0 * 8 / scale_num;
    unsigned py1 = (y1 * 8 + scale_num - 1) / scale_num, px1 = (x1 * 8 + scale_num - 1) / scale_num;
    if (py1 > L.height) py1 = L.height;
    if (px1 > L.width) px1 = L.width;
    if (cut_rectangle(src, srclen, &L, py0, px0, py1, px1, &cut)) {
      cutbuf = cut.buf;
      oy = cut.oy * scale_num / 8;
      ox = cut.ox * scale_num / 8;
      y0 -= oy, y1 -= oy, x0 -= ox, x1 -= ox;
      p_jpeg_abort_decompress(&cinfo);
      p_jpeg_mem_src(&cinfo, cut.buf, (unsigned long)cut.len);
      p_jpeg_read_header(&cinfo, TRUE);
      cinfo.scale_num = (unsigned int)scale_num;
      cinfo.scale_denom = 8;
    }
  }
  cinfo.out_color_space = cinfo.jpeg_color_space == JCS_GRAYSCALE && !rgb ? JCS_GRAYSCALE : JCS_RGB;
  p_jpeg_start_decompress(&cinfo);
  JDIMENSION xoff = x0, width = x1 - x0;
  if (width < cinfo.output_width) p_jpeg_crop_scanline(&cinfo, &xoff, &width);
  const int channels = cinfo.output_components;
  const size_t stride = (size_t)width * channels;
  const JDIMENSION rows = y1 - y0;
  PyEval_RestoreThread(ts);
  pixels = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * rows));
  ts = PyEval_SaveThread();
  if (pixels == NULL) {
    snprintf(err.message, sizeof(err.message), "out of memory for %u rows of %zu bytes", rows, stride);
    longjmp(err.jump, 1);
  }
  unsigned char *base = (unsigned char *)PyByteArray_AS_STRING(pixels);
  if (y0 > 0) p_jpeg_skip_scanlines(&cinfo, y0);
  JSAMPROW rowptrs[16];
  while (cinfo.output_scanline < y1) {
    JDIMENSION k, n = y1 - cinfo.output_scanline;
    if (n > 16) n = 16;
    for (k = 0; k < n; k++) rowptrs[k] = base + (size_t)(cinfo.output_scanline - y0 + k) * stride;
    p_jpeg_read_scanlines(&cinfo, rowptrs, n);
  }
  p_jpeg_abort_decompress(&cinfo); /* the rows below the box stay undecoded */
  p_jpeg_destroy_decompress(&cinfo);
  free((void *)cutbuf);
  PyEval_RestoreThread(ts);
  PyBuffer_Release(&data);
  return Py_BuildValue("(NIIIi)", pixels, rows, xoff + ox, width, channels);
}

/* restart(data, target_px) -> bytes: the same JPEG, losslessly, with restart markers.

The DCT coefficients are copied, not re-quantised, so every decoder gives the same pixels as
before; the output is baseline sequential (a progressive input becomes sequential), with
optimised Huffman tables and the input's APPn/COM markers. The restart interval is the divisor
of the MCUs per row whose width is nearest target_px (by ratio; the whole row when the row has
no divisor near it), so intervals line up with rows and columns: what decode() needs to cut a
box out without entropy-decoding the rest. */
static PyObject *restart(PyObject *self, PyObject *args) {
  Py_buffer data;
  unsigned int target;
  (void)self;
  if (lib_handle == NULL) return not_loaded();
  if (!PyArg_ParseTuple(args, "y*I", &data, &target)) return NULL;
  struct jpeg_decompress_struct src;
  struct jpeg_compress_struct dst;
  ErrorMgr err; /* one for both sides, as they run one after the other */
  unsigned char *volatile outbuf = NULL;
  unsigned long outlen = 0;
  volatile int dst_made = 0;
  setup(&src, &err);
  dst.err = &err.pub;
  PyThreadState *volatile ts = PyEval_SaveThread();
  if (setjmp(err.jump)) {
    if (dst_made) p_jpeg_destroy_compress(&dst);
    p_jpeg_destroy_decompress(&src);
    free(outbuf);
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_ValueError, err.message);
    return NULL;
  }
  p_jpeg_CreateDecompress(&src, JPEG_LIB_VERSION, sizeof(src));
  p_jpeg_mem_src(&src, (const unsigned char *)data.buf, (unsigned long)data.len);
  p_jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
  for (int m = 0; m < 16; m++) p_jpeg_save_markers(&src, JPEG_APP0 + m, 0xFFFF);
  p_jpeg_read_header(&src, TRUE);
  jvirt_barray_ptr *coefs = p_jpeg_read_coefficients(&src);
  p_jpeg_CreateCompress(&dst, JPEG_LIB_VERSION, sizeof(dst));
  dst_made = 1;
  p_jpeg_copy_critical_parameters(&src, &dst);
  unsigned mcu_w = src.num_components == 1 ? 8 : 8 * (unsigned)src.max_h_samp_factor;
  unsigned per_row = (src.image_width + mcu_w - 1) / mcu_w, interval = per_row;
  double best = 1e300;
  for (unsigned d = 1; d <= per_row; d++) { /* the divisor nearest target_px, by ratio */
    if (per_row % d) continue;
    double r = (double)(d * mcu_w) / (target ? target : 1);
    if (r < 1) r = 1 / r;
    if (r < best) best = r, interval = d;
  }
  dst.restart_interval = interval;
  dst.optimize_coding = TRUE;
  p_jpeg_mem_dest(&dst, (unsigned char **)&outbuf, &outlen);
  p_jpeg_write_coefficients(&dst, coefs);
  for (jpeg_saved_marker_ptr mk = src.marker_list; mk != NULL; mk = mk->next) {
    if (dst.write_JFIF_header && mk->marker == JPEG_APP0 && mk->data_length >= 5 &&
        memcmp(mk->data, "JFIF", 5) == 0)
      continue; /* libjpeg writes its own */
    if (dst.write_Adobe_marker && mk->marker == JPEG_APP0 + 14 && mk->data_length >= 5 &&
        memcmp(mk->data, "Adobe", 5) == 0)
      continue;
    p_jpeg_write_marker(&dst, mk->marker, mk->data, mk->data_length);
  }
  p_jpeg_finish_compress(&dst);
  p_jpeg_finish_decompress(&src);
  p_jpeg_destroy_compress(&dst);
  p_jpeg_destroy_decompress(&src);
  PyEval_RestoreThread(ts);
  PyBuffer_Release(&data);
  PyObject *out = PyBytes_FromStringAndSize((const char *)outbuf, (Py_ssize_t)outlen);
  free(outbuf);
  return out;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open the libjpeg-turbo shared library at path (6.2 ABI)."},
    {"header", header, METH_VARARGS, "header(data) -> (height, width, components, jpeg_color_space)."},
    {"decode", decode, METH_VARARGS,
     "decode(data, scale_num, y0, x0, y1, x1, rgb=True) -> (bytearray, rows, x_offset, width, channels)."},
    {"restart", restart, METH_VARARGS, "restart(data, target_px) -> the same JPEG with restart markers."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "libjpeg_binding", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_libjpeg_binding(void) { return PyModule_Create(&module); }
