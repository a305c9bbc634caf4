/* Decode only a region of a JPEG, at a reduced DCT scale, with libjpeg-turbo.
 *
 * decode_region(data, denom, x, y, w, h, out) decodes the rectangle (x, y, w, h) of the image
 * scaled by 1/denom (denom in 1, 2, 4, 8) into `out`, a writable C-contiguous buffer of
 * h * w * 3 bytes (RGB), from a baseline (sequential) JPEG. The pixels are the same as
 * decoding the whole image with the fast integer DCT and fast upsampling, then cropping;
 * what it saves:
 *   - rows below the region are never read (no Huffman decoding either);
 *   - rows above it are skipped with jpeg_skip_scanlines (entropy-decoded, not transformed);
 *   - columns outside it are not transformed, upsampled or converted (jpeg_crop_scanline).
 * Since rows below the region are never read, damage there goes unseen, and libjpeg notices
 * much damage only at the end of a scan: use it on files that have decoded whole without
 * error before. Any libjpeg warning is an error (as simplejpeg's strict mode).
 * Raises ValueError with libjpeg's message, or with ": decode it whole" for what it does not
 * handle (progressive, CMYK/YCCK, lossless...): the caller decodes those some other way.
 * The GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#if !defined(JCS_EXTENSIONS) || !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2001003
/* 2.1.3 fixed jpeg_crop_scanline() with fast 4:2:0 upsampling writing past the output rows. */
#error "libjpeg-turbo 2.1.3 or later is required"
#endif

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
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

/* Returns NULL on success, else a static message or err->message. */
static const char *decode(const unsigned char *data, size_t size, int denom, JDIMENSION x,
                          JDIMENSION y, JDIMENSION w, JDIMENSION h, unsigned char *out,
                          error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    /* volatile: modified after setjmp and read after longjmp */
    unsigned char *volatile row = NULL;
    const char *volatile problem = NULL;

    cinfo.err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->message[0] = '\0';
    if (setjmp(err->jump)) {
        free(row);
        jpeg_destroy_decompress(&cinfo);
        return problem ? problem : err->message;
    }
    jpeg_create_decompress(&cinfo);
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
    /* Rows are decoded straight into out when the region spans whole iMCU columns, else
     * into a band of up to 16 rows (the most libjpeg returns at once) and copied from it. */
    const size_t skip = (size_t)(x - left) * 3, line = (size_t)w * 3;
    const int direct = (left == x && width == w);
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
            rows[i] = direct ? out + (done + i) * line : row + (size_t)i * width * 3;
        }
        JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want);
        if (got == 0) {
            problem = "truncated JPEG";
            longjmp(err->jump, 1);
        }
        if (!direct) {
            for (JDIMENSION i = 0; i < got; i++) {
                memcpy(out + (done + i) * line, rows[i] + skip, line);
            }
        }
        done += got;
    }
    free(row);
    row = NULL;
    /* The rows below the region are never decoded. */
    jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return NULL;
}

static PyObject *decode_region(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data, out;
    int denom;
    Py_ssize_t x, y, w, h; /* "n" checks for overflow; "I" would silently wrap */
    if (!PyArg_ParseTuple(args, "y*innnnw*", &data, &denom, &x, &y, &w, &h, &out)) {
        return NULL;
    }
    PyObject *result = NULL;
    error_mgr err;
    const char *problem = NULL;
    const Py_ssize_t most = 1 << 16; /* JPEG sides are 16-bit */
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8");
    } else if (x < 0 || y < 0 || w < 0 || h < 0 || x > most || y > most || w > most || h > most) {
        PyErr_SetString(PyExc_ValueError, "region outside the scaled image");
    } else if (!PyBuffer_IsContiguous(&out, 'C') || (size_t)out.len != (size_t)w * (size_t)h * 3) {
        PyErr_SetString(PyExc_ValueError, "out must be a contiguous buffer of h * w * 3 bytes");
    } else {
        Py_BEGIN_ALLOW_THREADS
        problem = decode((const unsigned char *)data.buf, (size_t)data.len, denom, (JDIMENSION)x,
                         (JDIMENSION)y, (JDIMENSION)w, (JDIMENSION)h, (unsigned char *)out.buf, &err);
        Py_END_ALLOW_THREADS
        if (problem) {
            PyErr_SetString(PyExc_ValueError, problem);
        } else {
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, denom, x, y, w, h, out): decode the region (x, y, w, h) of the JPEG "
     "scaled by 1/denom into out (h * w * 3 bytes, RGB)."},
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
