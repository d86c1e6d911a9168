/* buffers._groupscan: one pass over a packed trajectory group, in C.
 *
 * Why: the ZMQ broker checks every group it accepts, on the one thread that serves every
 * request. In Python and numpy that check cost ~40 us of a 1k-token group's ~60 us of broker
 * interpreter time (five numpy passes over the arrays, each with its own temporaries, plus
 * the unpacking). Here the packed layout (buffers/packing.py) is walked and the value checks
 * and the group's oldest version (asyncrl/wire/group.py: check_array_values and
 * TrajectoryGroup.min_version) are computed in one loop over the tokens, allocating nothing
 * but the header's bytes.
 *
 * The header (JSON) is left to Python: buffers/group_check.py parses it with orjson and applies
 * every rule in the order decode_group does, so both paths reject a group for the same reason.
 * Where this extension did not build, that module falls back to decode_group itself.
 *
 * scan(packed) -> (lengths, header, min_version, value_reason)
 *   lengths       tuple of the packed frames' sizes in bytes
 *   header        bytes of frame 0 (None when there are no frames)
 *   min_version   oldest non-negative token version, -1 if none (-2: not scanned)
 *   value_reason  None, "logprob" (a non-finite logprob on a trained token) or "version"
 *                 (a trained token without a version); the arrays are scanned only when there
 *                 are 5 frames whose sizes agree on one token count
 * A payload whose lengths do not add up raises ValueError (the caller's "frames" reason).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ALIGN 8
#define ALIGNED_FLAG 0x8000u
#define MAX_FRAMES 0x7fff

static uint32_t load_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The value checks and the oldest version over n tokens (little-endian int32 versions,
 * float32 logprobs, uint8 mask). Branch-free so the compiler can vectorize it. */
static void scan_tokens(const unsigned char *logprobs, const unsigned char *mask,
                        const unsigned char *versions, Py_ssize_t n, long *min_version,
                        const char **reason) {
    uint32_t oldest = UINT32_MAX; /* as uint32, every negative version is above every other */
    uint32_t bad_logprob = 0, bad_version = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t version = load_u32(versions + 4 * i);
        uint32_t bits = load_u32(logprobs + 4 * i);
        uint32_t trained = mask[i] != 0;
        oldest = version < oldest ? version : oldest;
        bad_version |= trained & (version >> 31);
        bad_logprob |= trained & (((bits >> 23) & 0xffu) == 0xffu); /* inf or nan */
    }
    *min_version = oldest < 0x80000000u ? (long)oldest : -1;
    *reason = bad_logprob ? "logprob" : bad_version ? "version" : NULL;
}

static PyObject *scan(PyObject *module, PyObject *packed) {
    Py_buffer view;
    if (PyObject_GetBuffer(packed, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = (const unsigned char *)view.buf;
    Py_ssize_t size = view.len;
    PyObject *lengths = NULL, *header = NULL, *result = NULL;
    Py_ssize_t offsets[5] = {0};
    uint32_t sizes[5] = {0};

    if (size < 2) {
        PyErr_SetString(PyExc_ValueError, "empty group payload");
        goto done;
    }
    unsigned count = (unsigned)data[0] | (unsigned)data[1] << 8;
    int aligned = (count & ALIGNED_FLAG) != 0;
    count &= MAX_FRAMES;
    Py_ssize_t start = 2 + 4 * (Py_ssize_t)count;
    if (size < start) {
        PyErr_Format(PyExc_ValueError, "group payload too short for %u frame lengths", count);
        goto done;
    }
    lengths = PyTuple_New(count);
    if (lengths == NULL)
        goto done;
    Py_ssize_t end = start; /* 64-bit: 32767 lengths of up to 4 GiB cannot overflow */
    for (unsigned i = 0; i < count; i++) {
        uint32_t length = load_u32(data + 2 + 4 * i);
        if (aligned)
            end = (end + ALIGN - 1) / ALIGN * ALIGN;
        if (i < 5) {
            offsets[i] = end;
            sizes[i] = length;
        }
        end += length;
        PyObject *item = PyLong_FromUnsignedLong(length);
        if (item == NULL || PyTuple_SetItem(lengths, i, item) < 0)
            goto done;
    }
    if (end != size) {
        PyErr_SetString(PyExc_ValueError, "group frame lengths do not add up to the payload");
        goto done;
    }
    if (count > 0) {
        header = PyBytes_FromStringAndSize((const char *)data + offsets[0], sizes[0]);
        if (header == NULL)
            goto done;
    } else {
        header = Py_None;
        Py_INCREF(header);
    }
    long min_version = -2;
    const char *reason = NULL;
    Py_ssize_t n = count == 5 ? (Py_ssize_t)sizes[3] : -1;
    if (n >= 0 && sizes[1] == 4 * (uint64_t)n && sizes[2] == 4 * (uint64_t)n
            && sizes[4] == 4 * (uint64_t)n) {
        scan_tokens(data + offsets[2], data + offsets[3], data + offsets[4], n, &min_version,
                    &reason);
    }
    result = Py_BuildValue("(OOlz)", lengths, header, min_version, reason);
done:
    Py_XDECREF(lengths);
    Py_XDECREF(header);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O,
     "scan(packed) -> (lengths, header, min_version, value_reason): see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_groupscan",
    "One C pass over a packed trajectory group (see buffers.group_check).", -1, methods,
};

PyMODINIT_FUNC PyInit__groupscan(void) {
    return PyModule_Create(&module_def);
}
