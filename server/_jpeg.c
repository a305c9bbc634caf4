/* Decode only a region of a JPEG, at a reduced DCT scale, with libjpeg-turbo.
 *
 * decode_region(data, denom, x, y, w, h, out[, max_scans, pitch, whole]) decodes the rectangle (x, y, w, h) of the
 * image scaled by 1/denom (denom in 1, 2, 4, 8) into `out`, a writable C-contiguous buffer of
 * h rows of `pitch` pixels (default w), 3 bytes each (RGB), from a baseline (sequential) JPEG, and
 * returns the column where the region starts in each row: libjpeg decodes from the iMCU column
 * left of x, so with pitch >= w + 31 it writes the rows in place, else it decodes into a band and
 * copies the region to column 0. The pixels are the same as
 * decoding the whole image with the fast integer DCT and fast upsampling, then cropping;
 * what it saves:
 *   - rows below the region are never read (no Huffman decoding either);
 *   - rows above it are skipped with jpeg_skip_scanlines (entropy-decoded, not transformed);
 *   - columns outside it are not transformed, upsampled or converted (jpeg_crop_scanline).
 * Since rows below the region are never read, damage there goes unseen, and libjpeg notices
 * much damage only at the end of a scan: use it on files that have decoded whole without
 * error before, or pass whole=True. Any libjpeg warning is an error (as simplejpeg's strict mode).
 *
 * decode_region(..., whole=True) also reads the rest of the file as a whole decode does, so that
 * it fails exactly where one fails, for a file not known to decode: every failure of a whole
 * decode comes from reading the file (its markers and entropy-coded data, up to EOI), never from
 * the inverse DCT, upsampling or colour conversion, which cannot fail. The rows below the region
 * are entropy-decoded (jpeg_skip_scanlines) but not transformed, the last row is decoded (a skip
 * to the very end reads nothing), then jpeg_finish_decompress reads up to EOI. The restart-marker
 * cut (below) is not used then: it reads only the region's MCUs.
 * Raises ValueError with libjpeg's message, or with ": decode it whole" for what it does not
 * handle (progressive, CMYK/YCCK, lossless...): the caller decodes those some other way.
 * The GIL is released while decoding. With max_scans > 0, a JPEG of more scans is refused
 * (each scan is a pass over a component's blocks: repeating one makes a small file cost seconds).
 *
 * A JPEG with a restart marker after every MCU (what transcode() writes) is first cut down to
 * the region's MCUs: each MCU's entropy-coded bytes stand alone there (the DC predictions
 * restart at each marker), so the rows above the region and the columns beside it are not
 * even entropy-decoded. The cut is a smaller JPEG of the same blocks, so the pixels are the same.
 *
 * transcode(data[, max_pixels, max_scans]) rewrites a JPEG losslessly (the same DCT coefficients, hence the same
 * pixels) as baseline with optimized Huffman tables and a restart marker after every MCU,
 * keeping its APPn and COM markers; it raises ValueError for what libjpeg cannot read cleanly
 * and returns None for a JPEG with data after its end (an MPF part, a motion photo's video),
 * which a rewrite would drop. transcode(data, max_pixels, max_scans) also refuses a JPEG over
 * either limit (0: none) before reading its coefficients, which it holds in memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#if !defined(JCS_EXTENSIONS) || !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2001003
/* 2.1.3 fixed jpeg_crop_scanline() with fast 4:2:0 upsampling writing past the output rows. */
#error "libjpeg-turbo 2.1.3 or later is required"
#endif

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
    struct jpeg_progress_mgr progress;
    int max_scans; /* 0: no limit */
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt data that libjpeg would otherwise paper over */
        on_error(cinfo);
    }
}

/* libjpeg's standard error manager, with every warning an error and the message kept in err. */
static struct jpeg_error_mgr *strict_errors(error_mgr *err) {
    jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->message[0] = '\0';
    return &err->pub;
}

/* A JPEG may repeat a scan of one component any number of times, each one a pass over all of
 * that component's blocks: a few KB of scans can cost seconds. As jpegtran's -maxscans, the
 * progress monitor (called for every iMCU row of every scan read) stops at err->max_scans. */
static void check_scans(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    int scans = ((j_decompress_ptr)cinfo)->input_scan_number;
    if (err->max_scans > 0 && scans > err->max_scans) {
        snprintf(err->message, sizeof err->message, "JPEG has more than %d scans (a decoding cost bomb?)",
                 err->max_scans);
        longjmp(err->jump, 1);
    }
}

static void limit_scans(j_decompress_ptr cinfo, error_mgr *err) {
    err->progress.progress_monitor = check_scans;
    cinfo->progress = &err->progress;
}

/* Where a JPEG's blocks lie, for cutting out a region of MCUs (see the comment on top). */
typedef struct {
    size_t sof;      /* offset of the SOF segment's length field */
    size_t entropy;  /* offset of the first entropy-coded byte (after SOS) */
    unsigned width, height, mcu_w, mcu_h;
} layout;

static unsigned get16(const unsigned char *p) { return (unsigned)p[0] << 8 | p[1]; }

/* Fills `lay` and returns 1 for a baseline Huffman JPEG with one scan of all its components
 * and a restart marker after every MCU; 0 for anything else (decoded as it is). */
static int read_layout(const unsigned char *data, size_t size, layout *lay) {
    size_t i = 2;
    int restart_every_mcu = 0, have_frame = 0;
    unsigned components = 0, hmax = 1, vmax = 1;
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return 0;
    for (int steps = 0; steps < 512; steps++) {
        if (i + 4 > size || data[i] != 0xFF) return 0;
        unsigned marker = data[i + 1];
        if (marker == 0xFF) { i++; continue; }              /* fill byte */
        if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) { i += 2; continue; }
        size_t length = get16(data + i + 2);
        if (length < 2 || i + 2 + length > size) return 0;
        const unsigned char *seg = data + i + 4;
        if (marker == 0xC0 || marker == 0xC1) {              /* baseline or extended Huffman */
            if (have_frame || length < 8 || seg[0] != 8) return 0;
            lay->sof = i + 2;
            lay->height = get16(seg + 1);
            lay->width = get16(seg + 3);
            components = seg[5];
            /* Four components are CMYK or YCCK, which decode() leaves to a whole decode. */
            if (components < 1 || components > 3 || length != 8 + 3 * components || lay->height == 0 || lay->width == 0) return 0;
            for (unsigned c = 0; c < components; c++) {
                unsigned h = seg[6 + 3 * c + 1] >> 4, v = seg[6 + 3 * c + 1] & 15;
                if (h < 1 || h > 4 || v < 1 || v > 4) return 0;
                hmax = h > hmax ? h : hmax;
                vmax = v > vmax ? v : vmax;
            }
            have_frame = 1;
        } else if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) ||
                   marker == 0xD9) {
            return 0;                                         /* progressive, lossless, arithmetic... */
        } else if (marker == 0xDD) {                          /* DRI */
            if (length != 4) return 0;
            restart_every_mcu = get16(seg) == 1;
        } else if (marker == 0xDA) {                          /* SOS: the one scan must hold every component */
            if (!have_frame || !restart_every_mcu || length < 3 || seg[0] != components) return 0;
            lay->entropy = i + 2 + length;
            /* One component: an MCU is one block. Several: hmax x vmax blocks of 8 x 8 pixels. */
            lay->mcu_w = components == 1 ? 8 : 8 * hmax;
            lay->mcu_h = components == 1 ? 8 : 8 * vmax;
            return 1;
        }
        i += 2 + length;
    }
    return 0;
}

/* Cuts the MCU columns [c0, c1) of rows [r0, r1) out of a JPEG read by read_layout() into a
 * new JPEG at *cut (malloc'ed; *cut_size bytes): the header with the new size in its SOF,
 * the MCUs' entropy-coded segments, renumbered restart markers between them, EOI.
 * Returns 0 when the entropy-coded data does not hold the MCUs it should. */
static int cut_mcus(const unsigned char *data, size_t size, const layout *lay, unsigned c0, unsigned c1,
                    unsigned r0, unsigned r1, unsigned char **cut, size_t *cut_size) {
    const unsigned cols = (lay->width + lay->mcu_w - 1) / lay->mcu_w;
    const size_t first = (size_t)r0 * cols + c0, last = (size_t)(r1 - 1) * cols + c1; /* MCUs [first, last) */
    const size_t wanted = (size_t)(r1 - r0) * (c1 - c0);
    unsigned char *out = malloc(size + 2 * wanted + 2);
    if (out == NULL) return 0;
    memcpy(out, data, lay->entropy);
    const unsigned w = c1 * lay->mcu_w < lay->width ? (c1 - c0) * lay->mcu_w : lay->width - c0 * lay->mcu_w;
    const unsigned h = r1 * lay->mcu_h < lay->height ? (r1 - r0) * lay->mcu_h : lay->height - r0 * lay->mcu_h;
    out[lay->sof + 3] = h >> 8, out[lay->sof + 4] = h & 255;
    out[lay->sof + 5] = w >> 8, out[lay->sof + 6] = w & 255;
    const size_t total = (size_t)((lay->height + lay->mcu_h - 1) / lay->mcu_h) * cols;
    size_t n = lay->entropy, taken = 0, start = lay->entropy, mcu = 0;
    const unsigned char *end = data + size;
    for (; mcu < last; mcu++) {
        /* MCU `mcu`'s segment runs from `start` to the next marker: a 0xFF not followed by
         * 0x00 (a stuffed 0xFF byte) or by 0xFF (a fill byte before the marker). */
        const unsigned char *q = data + start;
        for (;;) {
            q = memchr(q, 0xFF, (size_t)(end - q));
            if (q == NULL || q + 1 >= end) break;
            if (q[1] == 0x00) q += 2;
            else if (q[1] == 0xFF) q += 1;
            else break;
        }
        if (q == NULL || q + 1 >= end) break;
        const int restart = q[1] >= 0xD0 && q[1] <= 0xD7;
        if (restart ? q[1] != 0xD0 + mcu % 8 : mcu + 1 != total) break; /* not the MCUs we expect */
        if (mcu >= first && mcu % cols >= c0 && mcu % cols < c1) {
            if (taken > 0) out[n++] = 0xFF, out[n++] = (unsigned char)(0xD0 + (taken - 1) % 8);
            memcpy(out + n, data + start, (size_t)(q - data) - start);
            n += (size_t)(q - data) - start;
            taken++;
        }
        start = (size_t)(q - data) + 2;
    }
    if (mcu < last || taken != wanted) {
        free(out);
        return 0;
    }
    out[n++] = 0xFF, out[n++] = 0xD9;
    *cut = out;
    *cut_size = n;
    return 1;
}

/* decode(..., whole=1)'s end: reads the rest of the file as a whole decode would (see the
 * comment on top), the rows below the region entropy-decoded only. On failure it sets *problem
 * (or libjpeg's message is in err) and jumps to decode()'s handler, which frees *row. */
static void read_rest(j_decompress_ptr cinfo, unsigned char *volatile *row, const char *volatile *problem,
                      error_mgr *err) {
    const JDIMENSION rest = cinfo->output_height - cinfo->output_scanline;
    if (rest > 1 && jpeg_skip_scanlines(cinfo, rest - 1) != rest - 1) {
        *problem = "could not read past the region";
        longjmp(err->jump, 1);
    }
    if (rest > 0) { /* skipping to the very end would read nothing: the last row is decoded */
        *row = malloc((size_t)cinfo->output_width * 3);
        if (*row == NULL) {
            *problem = "out of memory";
            longjmp(err->jump, 1);
        }
        JSAMPROW last = *row;
        if (jpeg_read_scanlines(cinfo, &last, 1) != 1) {
            *problem = "truncated JPEG";
            longjmp(err->jump, 1);
        }
        free(*row);
        *row = NULL;
    }
    jpeg_finish_decompress(cinfo); /* the markers up to EOI, as a whole decode reads them */
}

/* Returns NULL on success, else a static message or err->message. */
static const char *decode(const unsigned char *data, size_t size, int denom, JDIMENSION x,
                          JDIMENSION y, JDIMENSION w, JDIMENSION h, unsigned char *out, size_t pitch,
                          JDIMENSION *column, int whole, error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    /* volatile: modified after setjmp and read after longjmp */
    unsigned char *volatile row = NULL;
    const char *volatile problem = NULL;

    cinfo.err = strict_errors(err);
    if (setjmp(err->jump)) {
        free(row);
        jpeg_destroy_decompress(&cinfo);
        return problem ? problem : err->message;
    }
    jpeg_create_decompress(&cinfo);
    limit_scans(&cinfo, err);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.progressive_mode) {
        /* Its scans are all read before the first row anyway, so little is saved; and an
         * incomplete one is smoothed across blocks, where a crop's edge would count as the image's. */
        problem = "progressive JPEG: decode it whole";
        longjmp(err->jump, 1);
    }
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        problem = "CMYK or YCCK JPEG: decode it whole";
        longjmp(err->jump, 1);
    }
    cinfo.out_color_space = JCS_EXT_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    cinfo.dct_method = JDCT_IFAST;
    cinfo.do_fancy_upsampling = FALSE;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3) {
        problem = "not RGB: decode it whole";
        longjmp(err->jump, 1);
    }
    if (w == 0 || h == 0 || x >= cinfo.output_width || w > cinfo.output_width - x ||
        y >= cinfo.output_height || h > cinfo.output_height - y) {
        problem = "region outside the scaled image";
        longjmp(err->jump, 1);
    }
    JDIMENSION left = x, width = w;
    if (x != 0 || w != cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &left, &width); /* widens to iMCU boundaries */
    }
    /* Rows are decoded straight into out when the widened rows fit its pitch, the region
     * starting at column x - left; else into a band of up to 16 rows (the most libjpeg
     * returns at once) and copied from it to column 0. */
    const size_t skip = (size_t)(x - left) * 3, line = (size_t)w * 3, stride = pitch * 3;
    const int direct = width <= pitch;
    *column = direct ? x - left : 0;
    if (!direct) {
        row = malloc((size_t)width * 3 * 16);
        if (row == NULL) {
            problem = "out of memory";
            longjmp(err->jump, 1);
        }
    }
    if (y > 0 && jpeg_skip_scanlines(&cinfo, y) != y) {
        problem = "could not skip to the region";
        longjmp(err->jump, 1);
    }
    JSAMPROW rows[16];
    for (JDIMENSION done = 0; done < h;) {
        JDIMENSION want = h - done < 16 ? h - done : 16;
        for (JDIMENSION i = 0; i < want; i++) {
            rows[i] = direct ? out + (done + i) * stride : row + (size_t)i * width * 3;
        }
        JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want);
        if (got == 0) {
            problem = "truncated JPEG";
            longjmp(err->jump, 1);
        }
        if (!direct) {
            for (JDIMENSION i = 0; i < got; i++) {
                memcpy(out + (done + i) * stride, rows[i] + skip, line);
            }
        }
        done += got;
    }
    free(row);
    row = NULL;
    if (whole) {
        read_rest(&cinfo, &row, &problem, err);
    } else {
        jpeg_abort_decompress(&cinfo); /* the rows below the region are never decoded */
    }
    jpeg_destroy_decompress(&cinfo);
    return NULL;
}

/* decode(), from the region's MCUs only when the JPEG has a restart marker after each MCU. */
static const char *decode_cut(const unsigned char *data, size_t size, int denom, JDIMENSION x, JDIMENSION y,
                              JDIMENSION w, JDIMENSION h, unsigned char *out, size_t pitch, JDIMENSION *column,
                              int whole, error_mgr *err) {
    layout lay = {0};
    unsigned char *cut = NULL;
    size_t cut_size = 0;
    if (!whole && w > 0 && h > 0 && read_layout(data, size, &lay)) {
        /* In the image scaled by 1/denom, an MCU is mcu_w / denom x mcu_h / denom pixels. */
        const unsigned sw = lay.mcu_w / denom, sh = lay.mcu_h / denom;
        const unsigned out_w = (lay.width + denom - 1) / denom, out_h = (lay.height + denom - 1) / denom;
        if (x < out_w && w <= out_w - x && y < out_h && h <= out_h - y) {
            const unsigned c0 = x / sw, r0 = y / sh;
            if (cut_mcus(data, size, &lay, c0, (x + w + sw - 1) / sw, r0, (y + h + sh - 1) / sh, &cut, &cut_size)) {
                const char *problem =
                    decode(cut, cut_size, denom, x - c0 * sw, y - r0 * sh, w, h, out, pitch, column, 0, err);
                free(cut);
                return problem;
            }
        }
    }
    return decode(data, size, denom, x, y, w, h, out, pitch, column, whole, err);
}

static PyObject *decode_region(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data, out;
    int denom, max_scans = 0, whole = 0;
    Py_ssize_t x, y, w, h, pitch = -1; /* "n" checks for overflow; "I" would silently wrap */
    if (!PyArg_ParseTuple(args, "y*innnnw*|inp", &data, &denom, &x, &y, &w, &h, &out, &max_scans, &pitch, &whole)) {
        return NULL;
    }
    if (pitch < 0) pitch = w;
    JDIMENSION column = 0;
    PyObject *result = NULL;
    error_mgr err = {.max_scans = max_scans};
    const char *problem = NULL;
    const Py_ssize_t most = 1 << 16; /* JPEG sides are 16-bit */
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8");
    } else if (x < 0 || y < 0 || w < 0 || h < 0 || x > most || y > most || w > most || h > most) {
        PyErr_SetString(PyExc_ValueError, "region outside the scaled image");
    } else if (pitch < w || pitch > w + most) {
        PyErr_SetString(PyExc_ValueError, "pitch must be at least w and at most w + 65536");
    } else if (!PyBuffer_IsContiguous(&out, 'C') || (size_t)out.len != (size_t)pitch * (size_t)h * 3) {
        PyErr_SetString(PyExc_ValueError, "out must be a contiguous buffer of h * pitch * 3 bytes");
    } else {
        Py_BEGIN_ALLOW_THREADS
        problem = decode_cut((const unsigned char *)data.buf, (size_t)data.len, denom, (JDIMENSION)x,
                             (JDIMENSION)y, (JDIMENSION)w, (JDIMENSION)h, (unsigned char *)out.buf, (size_t)pitch,
                             &column, whole, &err);
        Py_END_ALLOW_THREADS
        if (problem) {
            PyErr_SetString(PyExc_ValueError, problem);
        } else {
            result = PyLong_FromUnsignedLong(column);
        }
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* transcode()'s output: a buffer that doubles as libjpeg fills it, owned here (not by libjpeg,
 * whose jpeg_mem_dest buffer cannot be freed safely after an error). */
typedef struct {
    struct jpeg_destination_mgr pub;
    unsigned char *buffer;
    size_t size, used;
} growing_dest;

static void dest_init(j_compress_ptr cinfo) {
    growing_dest *dest = (growing_dest *)cinfo->dest;
    dest->pub.next_output_byte = dest->buffer;
    dest->pub.free_in_buffer = dest->size;
}

static boolean dest_grow(j_compress_ptr cinfo) { /* called with the whole buffer full */
    growing_dest *dest = (growing_dest *)cinfo->dest;
    unsigned char *bigger = dest->size <= ((size_t)-1) / 2 ? realloc(dest->buffer, dest->size * 2) : NULL;
    if (bigger == NULL) {
        ERREXIT1(cinfo, JERR_OUT_OF_MEMORY, 10);
    }
    dest->buffer = bigger;
    dest->pub.next_output_byte = bigger + dest->size;
    dest->pub.free_in_buffer = dest->size;
    dest->size *= 2;
    return TRUE;
}

static void dest_term(j_compress_ptr cinfo) {
    growing_dest *dest = (growing_dest *)cinfo->dest;
    dest->used = dest->size - dest->pub.free_in_buffer;
}

/* transcode() keeps a JPEG with more than padding after its end as it is (it returns None). */
static const char TRAILING_DATA[] = "data after the end of the image";

/* transcode(): see the comment on top. Returns NULL on success (the JPEG in dest->buffer,
 * dest->used bytes), else a message. The caller frees dest->buffer either way. */
static const char *transcode_jpeg(const unsigned char *data, size_t size, Py_ssize_t max_pixels, growing_dest *dest,
                                  error_mgr *err) {
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    volatile int have_dst = 0;
    const char *volatile problem = NULL;
    src.err = strict_errors(err);
    if (setjmp(err->jump)) {
        if (have_dst) jpeg_destroy_compress(&dst);
        jpeg_destroy_decompress(&src);
        return problem ? problem : err->message;
    }
    jpeg_create_decompress(&src);
    limit_scans(&src, err);
    jpeg_mem_src(&src, data, (unsigned long)size);
    jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
    for (int m = 0; m < 16; m++) jpeg_save_markers(&src, JPEG_APP0 + m, 0xFFFF);
    jpeg_read_header(&src, TRUE);
    /* All coefficients are held in memory, and reading them may cost far more than the file's size. */
    if (max_pixels > 0 && (unsigned long long)src.image_width * src.image_height > (unsigned long long)max_pixels) {
        snprintf(err->message, sizeof err->message, "image is %ux%u = %llu pixels, over the limit of %lld",
                 src.image_width, src.image_height, (unsigned long long)src.image_width * src.image_height,
                 (long long)max_pixels);
        longjmp(err->jump, 1);
    }
    jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&src);
    /* The end of the image has been read: anything after it (an MPF second image, a motion
     * photo's video) would be lost, and the markers pointing at it left dangling. */
    if (src.src->bytes_in_buffer > 64) {
        problem = TRAILING_DATA;
        longjmp(err->jump, 1);
    }
    dst.err = src.err;
    jpeg_create_compress(&dst);
    have_dst = 1;
    dest->pub.init_destination = dest_init;
    dest->pub.empty_output_buffer = dest_grow;
    dest->pub.term_destination = dest_term;
    dst.dest = &dest->pub;
    jpeg_copy_critical_parameters(&src, &dst); /* sequential, Huffman: the defaults */
    dst.optimize_coding = TRUE;
    dst.restart_interval = 1;
    jpeg_write_coefficients(&dst, coefficients);
    for (jpeg_saved_marker_ptr m = src.marker_list; m != NULL; m = m->next) {
        /* libjpeg writes its own JFIF and Adobe markers (as jpegtran, do not repeat them). */
        if (dst.write_JFIF_header && m->marker == JPEG_APP0 && m->data_length >= 5 && memcmp(m->data, "JFIF", 5) == 0) continue;
        if (dst.write_Adobe_marker && m->marker == JPEG_APP0 + 14 && m->data_length >= 5 && memcmp(m->data, "Adobe", 5) == 0) continue;
        jpeg_write_marker(&dst, m->marker, m->data, m->data_length);
    }
    jpeg_finish_compress(&dst);
    jpeg_destroy_compress(&dst);
    jpeg_finish_decompress(&src);
    jpeg_destroy_decompress(&src);
    return NULL;
}

static PyObject *transcode(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    Py_ssize_t max_pixels = 0;
    int max_scans = 0;
    if (!PyArg_ParseTuple(args, "y*|ni", &data, &max_pixels, &max_scans)) {
        return NULL;
    }
    error_mgr err = {.max_scans = max_scans};
    growing_dest dest = {.size = (size_t)data.len + 4096, .used = 0};
    dest.buffer = malloc(dest.size);
    if (dest.buffer == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    const char *problem;
    Py_BEGIN_ALLOW_THREADS
    problem = transcode_jpeg((const unsigned char *)data.buf, (size_t)data.len, max_pixels, &dest, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyObject *result = NULL;
    if (problem == TRAILING_DATA) {
        result = Py_NewRef(Py_None);
    } else if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
    } else {
        result = PyBytes_FromStringAndSize((const char *)dest.buffer, (Py_ssize_t)dest.used);
    }
    free(dest.buffer);
    return result;
}

static PyObject *cuts(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    layout lay;
    if (!PyArg_ParseTuple(args, "y*", &data)) {
        return NULL;
    }
    int yes = read_layout((const unsigned char *)data.buf, (size_t)data.len, &lay);
    PyBuffer_Release(&data);
    return PyBool_FromLong(yes);
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, denom, x, y, w, h, out, max_scans=0, pitch=w, whole=False) -> int: decode the region "
     "(x, y, w, h) of the JPEG scaled by 1/denom into out (h rows of pitch pixels, RGB) and return the column "
     "where it starts in each row (0 unless pitch > w: then libjpeg's rows, widened to the iMCU column left of "
     "x, are written in place when they fit); a JPEG of more than max_scans scans (0: any) is refused. "
     "whole=True also reads the rest of the file (entropy-decoded, not transformed, up to EOI), so that it "
     "fails wherever a whole decode fails."},
    {"cuts", cuts, METH_VARARGS,
     "cuts(data) -> bool: whether decode_region decodes only a region's MCUs of this JPEG (baseline, "
     "one scan of all its components, a restart marker after every MCU, as transcode() writes it)."},
    {"transcode", transcode, METH_VARARGS,
     "transcode(data, max_pixels=0, max_scans=0) -> bytes | None: the same JPEG (same coefficients, same "
     "pixels) as baseline with optimized Huffman tables and a restart marker after every MCU, which "
     "decode_region cuts at; None for a JPEG with data after its end (kept as it is). A JPEG of more than "
     "max_pixels pixels or max_scans scans (0: any) is refused."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg", "Region decoding with libjpeg-turbo.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER",
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
                                             LIBJPEG_TURBO_VERSION_NUMBER
#else
                                             0
#endif
                                             ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
