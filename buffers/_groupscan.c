/* buffers._groupscan: the broker's whole check of one packed trajectory group, in C.
 *
 * Why: the ZMQ broker checks every group it accepts, on the one thread that serves every
 * request, so its interpreter time per group bounds the buffer (bench/RESULTS.md). In Python
 * and numpy the check cost ~40 us of a 1k-token group's ~60 us (five numpy passes over the
 * arrays, each with its own temporaries, plus the unpacking); the array half moved here first
 * and took ~30 us off. What remained, the header's rules and the size checks in Python, was
 * then the largest item left (~8 us a group): they are here too, applied to the object that
 * orjson parsed with the same Python operations (float(), int(), str(), ==), so the verdicts
 * cannot drift from asyncrl/wire/group.py's decode_header.
 *
 * check(packed, loads, schema, max_bytes) -> (nbytes, run_id, min_version, value_reason)
 *   packed        a packed group (buffers/packing.py), any object with the buffer protocol
 *   loads         orjson.loads: the header frame's JSON parser
 *   schema        asyncrl.wire.SCHEMA_VERSION
 *   max_bytes     a payload larger than this is "oversized"; negative: no bound
 *   nbytes        the payload's size
 *   run_id        str(header.get("run_id", ""))
 *   min_version   oldest non-negative token version, -1 if none
 *   value_reason  None, "logprob" (a non-finite logprob on a trained token) or "version"
 *                 (a trained token without a version): the caller words these
 *                 (asyncrl.wire.VALUE_ERRORS)
 * A group that breaks a rule raises GroupError(reason, detail) with decode_group's reason and
 * message, checked in decode_group's order: size, packing, frame count (at least the five fixed
 * frames), header (its optional "extras" declarations last), frame count (five plus one per
 * extra), array sizes, extra sizes, values. tests/buffers/test_group_check.py holds both paths
 * to the same outcome.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALIGN 8
#define ALIGNED_FLAG 0x8000u
#define MAX_FRAMES 0x7fff
#define FRAMES 5 /* header + the four arrays of asyncrl/wire/group.py's _ARRAYS */
#define MAX_EXTRAS 16 /* asyncrl.wire.group.MAX_EXTRAS */
#define MAX_EXTRA_DIMS 8 /* asyncrl.wire.group.MAX_EXTRA_DIMS */
#define MAX_LAID (FRAMES + MAX_EXTRAS)

/* asyncrl.wire.group.EXTRA_DTYPES, in its order; the digit is the item size. */
static const char *EXTRA_DTYPES[] = {"u1", "i1", "u2", "i2", "u4", "i4", "f2", "f4"};
#define NUM_EXTRA_DTYPES (sizeof(EXTRA_DTYPES) / sizeof(EXTRA_DTYPES[0]))
#define EXTRA_DTYPE_LIST "u1, i1, u2, i2, u4, i4, f2, f4"

/* _ARRAYS' names and item sizes, in frame order (frames 1-4), for the size check's message. */
static const char *ARRAY_NAMES[FRAMES - 1] = {"tokens", "logprobs", "loss_mask", "versions"};
static const long long ITEM_SIZES[FRAMES - 1] = {4, 4, 1, 4};

static PyObject *GroupError; /* set once at import; ValueError's subclass */

static uint32_t load_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Raise GroupError(reason, detail); steals detail (NULL: its own error is already set). */
static int reject(const char *reason, PyObject *detail) {
    if (detail == NULL)
        return -1;
    PyObject *args = Py_BuildValue("(sN)", reason, detail);
    if (args != NULL) {
        PyErr_SetObject(GroupError, args);
        Py_DECREF(args);
    }
    return -1;
}

/* The packed layout: frame count, offsets and sizes of the first MAX_LAID frames. */
typedef struct {
    unsigned count;
    Py_ssize_t offsets[MAX_LAID];
    uint32_t sizes[MAX_LAID];
} Layout;

static int walk(const unsigned char *data, Py_ssize_t size, Layout *layout) {
    if (size < 2)
        return reject("frames", PyUnicode_FromString("empty group payload"));
    unsigned count = (unsigned)data[0] | (unsigned)data[1] << 8;
    int aligned = (count & ALIGNED_FLAG) != 0;
    count &= MAX_FRAMES;
    Py_ssize_t start = 2 + 4 * (Py_ssize_t)count;
    if (size < start)
        return reject("frames", PyUnicode_FromFormat(
            "group payload too short for %u frame lengths", count));
    Py_ssize_t end = start; /* 64-bit: 32767 lengths of up to 4 GiB cannot overflow */
    for (unsigned i = 0; i < count; i++) {
        uint32_t length = load_u32(data + 2 + 4 * i);
        if (aligned)
            end = (end + ALIGN - 1) / ALIGN * ALIGN;
        if (i < MAX_LAID) {
            layout->offsets[i] = end;
            layout->sizes[i] = length;
        }
        end += length;
    }
    if (end != size)
        return reject("frames", PyUnicode_FromString(
            "group frame lengths do not add up to the payload"));
    layout->count = count;
    return 0;
}

/* Take the exception being raised and return its str() (NULL: that failed, an error is set). */
static PyObject *pop_error_text(void) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return text;
}

/* A header field's conversion failed: where decode_header catches the exception (KeyError,
 * TypeError, ValueError) reject with its message; anything else propagates, as there. */
static int field_error(void) {
    if (!PyErr_ExceptionMatches(PyExc_KeyError) && !PyErr_ExceptionMatches(PyExc_TypeError)
            && !PyErr_ExceptionMatches(PyExc_ValueError))
        return -1;
    PyObject *text = pop_error_text();
    if (text == NULL)
        return -1;
    PyObject *detail = PyUnicode_FromFormat("missing or bad header field: %U", text);
    Py_DECREF(text);
    return reject("header", detail);
}

/* One declared extra: borrowed from the parsed header, which outlives the check. */
typedef struct {
    PyObject *name, *dtype, *shape;
    long long nbytes; /* prod(shape) * item size, unless too_big */
    int too_big;      /* past 64 bits: no frame can hold it */
} Extra;

/* What the header's lists hold, as decode_header computes them. */
typedef struct {
    Py_ssize_t rewards, lengths, reasons;
    int nonfinite_reward, nonpositive_length;
    long long tokens;  /* sum(lengths) while it fits */
    PyObject *big_tokens; /* sum(lengths) as a Python int once it does not (owned) */
    Py_ssize_t num_extras;
    Extra extras[MAX_EXTRAS];
} Fields;

typedef int (*ItemCheck)(PyObject *item, Fields *fields);

/* for item in header[key]: check(item) -- Python's iteration, so a string field iterates its
 * characters and a dict its keys, as in decode_header. */
static int each_item(PyObject *header, const char *key, ItemCheck check, Fields *fields) {
    PyObject *value = PyMapping_GetItemString(header, key);
    PyObject *iter = value != NULL ? PyObject_GetIter(value) : NULL;
    Py_XDECREF(value);
    if (iter == NULL)
        return -1;
    PyObject *item;
    while ((item = PyIter_Next(iter)) != NULL) {
        int failed = check(item, fields) < 0;
        Py_DECREF(item);
        if (failed)
            break;
    }
    Py_DECREF(iter);
    return PyErr_Occurred() ? -1 : 0;
}

static int check_reward(PyObject *item, Fields *fields) {
    double reward = NAN; /* orjson writes NaN/inf as null: a null reward is non-finite */
    if (item != Py_None) {
        PyObject *number = PyNumber_Float(item);
        if (number == NULL)
            return -1;
        reward = PyFloat_AsDouble(number);
        Py_DECREF(number);
    }
    fields->nonfinite_reward |= !isfinite(reward);
    fields->rewards++;
    return 0;
}

static int add_length(PyObject *number, Fields *fields) {
    int overflow = 0;
    long long length = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (length == -1 && PyErr_Occurred())
        return -1;
    fields->nonpositive_length |= overflow < 0 || (overflow == 0 && length <= 0);
    if (fields->big_tokens == NULL && overflow == 0 && length >= 0
            && fields->tokens <= LLONG_MAX - length) {
        fields->tokens += length;
        return 0;
    }
    if (fields->big_tokens == NULL) { /* from here on, Python ints */
        fields->big_tokens = PyLong_FromLongLong(fields->tokens);
        if (fields->big_tokens == NULL)
            return -1;
    }
    PyObject *sum = PyNumber_Add(fields->big_tokens, number);
    if (sum == NULL)
        return -1;
    Py_DECREF(fields->big_tokens);
    fields->big_tokens = sum;
    return 0;
}

static int check_length(PyObject *item, Fields *fields) {
    PyObject *number = PyNumber_Long(item); /* int(): "12" and 12.5 pass, as there */
    if (number == NULL)
        return -1;
    int failed = add_length(number, fields) < 0;
    Py_DECREF(number);
    if (failed)
        return -1;
    fields->lengths++;
    return 0;
}

/* The reasons' and ids' values are not kept, but str() of each runs, as there. */
static int check_reason(PyObject *item, Fields *fields) {
    PyObject *text = PyObject_Str(item);
    if (text == NULL)
        return -1;
    Py_DECREF(text);
    fields->reasons++;
    return 0;
}

static int check_id(PyObject *header, const char *key) {
    PyObject *value = PyMapping_GetItemString(header, key);
    PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
    Py_XDECREF(value);
    Py_XDECREF(text);
    return text == NULL ? -1 : 0;
}

/* A shape dimension: type(d) is int and d >= 0; *dim its value (LLONG_MAX past 64 bits). */
static int shape_dim(PyObject *item, long long *dim) {
    if (!PyLong_CheckExact(item))
        return 0;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0 || (overflow == 0 && value < 0))
        return 0;
    *dim = overflow > 0 ? LLONG_MAX : value;
    return 1;
}

/* The declared size of a valid shape, as math.prod(shape) * item size. */
static void extra_size(Extra *extra, int itemsize) {
    long long total = itemsize;
    int zero = 0, too_big = 0;
    for (Py_ssize_t i = 0; i < PyList_Size(extra->shape); i++) {
        long long dim = 0;
        shape_dim(PyList_GetItem(extra->shape, i), &dim); /* checked valid already */
        if (dim == 0)
            zero = 1;
        else if (too_big || total > LLONG_MAX / dim)
            too_big = 1;
        else
            total *= dim;
    }
    extra->nbytes = zero ? 0 : total;
    extra->too_big = !zero && too_big;
}

/* _extra_spec: one declaration's rules, in its order. */
static int check_extra(PyObject *entry, Extra *extra) {
    if (!PyDict_Check(entry))
        return reject("extras", PyUnicode_FromString("an extra is not an object"));
    PyObject *name = PyDict_GetItemString(entry, "name"); /* borrowed; missing: None */
    PyObject *dtype = PyDict_GetItemString(entry, "dtype");
    PyObject *shape = PyDict_GetItemString(entry, "shape");
    name = name != NULL ? name : Py_None;
    dtype = dtype != NULL ? dtype : Py_None;
    shape = shape != NULL ? shape : Py_None;
    if (!PyUnicode_Check(name) || PyUnicode_GetLength(name) == 0)
        return reject("extras", PyUnicode_FromFormat(
            "extra name %R is not a non-empty string", name));
    int itemsize = 0;
    for (size_t i = 0; PyUnicode_Check(dtype) && i < NUM_EXTRA_DTYPES; i++) {
        if (PyUnicode_CompareWithASCIIString(dtype, EXTRA_DTYPES[i]) == 0)
            itemsize = EXTRA_DTYPES[i][1] - '0';
    }
    if (PyErr_Occurred())
        return -1;
    if (itemsize == 0)
        return reject("extras", PyUnicode_FromFormat(
            "extra %R: dtype %R is not one of " EXTRA_DTYPE_LIST, name, dtype));
    int valid = PyList_Check(shape) && PyList_Size(shape) <= MAX_EXTRA_DIMS;
    for (Py_ssize_t i = 0; valid && i < PyList_Size(shape); i++) {
        long long dim = 0;
        valid = shape_dim(PyList_GetItem(shape, i), &dim);
        if (valid < 0)
            return -1;
    }
    if (!valid)
        return reject("extras", PyUnicode_FromFormat(
            "extra %R: shape %R is not a list of at most %d non-negative integers", name,
            shape, MAX_EXTRA_DIMS));
    extra->name = name;
    extra->dtype = dtype;
    extra->shape = shape;
    extra_size(extra, itemsize);
    return 0;
}

/* decode_extras on `header.get("extras") or []`. */
static int check_extras(PyObject *header, Fields *fields) {
    PyObject *extras = PyDict_GetItemString(header, "extras"); /* borrowed */
    int present = extras != NULL ? PyObject_IsTrue(extras) : 0;
    if (present <= 0)
        return present;
    if (!PyList_Check(extras))
        return reject("extras", PyUnicode_FromString("extras is not a list"));
    Py_ssize_t count = PyList_Size(extras);
    if (count > MAX_EXTRAS)
        return reject("extras", PyUnicode_FromFormat("%zd extras, at most %d", count,
                                                     MAX_EXTRAS));
    for (Py_ssize_t i = 0; i < count; i++) {
        Extra *extra = &fields->extras[i];
        if (check_extra(PyList_GetItem(extras, i), extra) < 0)
            return -1;
        for (Py_ssize_t j = 0; j < i; j++) {
            int same = PyObject_RichCompareBool(fields->extras[j].name, extra->name, Py_EQ);
            if (same < 0)
                return -1;
            if (same)
                return reject("extras", PyUnicode_FromFormat("extra %R is declared twice",
                                                             extra->name));
        }
        fields->num_extras = i + 1;
    }
    return 0;
}

/* decode_header's rules, in its order, on the parsed header; sets *run_id (new reference). */
static int check_header(PyObject *header, PyObject *schema, Fields *fields, PyObject **run_id) {
    if (!PyDict_Check(header))
        return reject("header", PyUnicode_FromString("header is not an object"));
    PyObject *version = PyDict_GetItemString(header, "schema"); /* borrowed */
    int differs = PyObject_RichCompareBool(version != NULL ? version : Py_None, schema, Py_NE);
    if (differs < 0)
        return -1;
    if (differs)
        return reject("schema", PyUnicode_FromFormat("unknown schema version %R",
                                                     version != NULL ? version : Py_None));
    if (each_item(header, "rewards", check_reward, fields) < 0
            || each_item(header, "lengths", check_length, fields) < 0
            || each_item(header, "finish_reasons", check_reason, fields) < 0
            || check_id(header, "group_id") < 0 || check_id(header, "prompt_id") < 0)
        return field_error();
    if (fields->lengths == 0 || fields->rewards != fields->lengths
            || fields->reasons != fields->lengths)
        return reject("length", PyUnicode_FromFormat(
            "%zd lengths, %zd rewards, %zd finish reasons", fields->lengths, fields->rewards,
            fields->reasons));
    if (fields->nonpositive_length)
        return reject("length", PyUnicode_FromString("sample lengths must be positive"));
    if (fields->nonfinite_reward)
        return reject("reward", PyUnicode_FromString("non-finite reward"));
    PyObject *metadata = PyDict_GetItemString(header, "metadata"); /* `or {}`: falsy is none */
    int present = metadata != NULL ? PyObject_IsTrue(metadata) : 0;
    if (present < 0)
        return -1;
    if (present && !PyDict_Check(metadata))
        return reject("header", PyUnicode_FromString("metadata is not an object"));
    if (check_extras(header, fields) < 0)
        return -1;
    PyObject *run = PyDict_GetItemString(header, "run_id");
    *run_id = run != NULL ? PyObject_Str(run) : PyUnicode_FromString("");
    return *run_id == NULL ? -1 : 0;
}

/* check_frame_count after the header: the five fixed frames and one per declared extra. */
static int check_count(const Layout *layout, const Fields *fields) {
    Py_ssize_t expected = FRAMES + fields->num_extras;
    if ((Py_ssize_t)layout->count == expected)
        return 0;
    return reject("frames", PyUnicode_FromFormat("expected %zd frames, got %u", expected,
                                                 layout->count));
}

/* check_array_sizes and check_extra_sizes: frames 1-4 against the header's token count, then
 * each extra's frame against its declared shape. */
static int check_sizes(const Layout *layout, const Fields *fields) {
    for (int i = 1; i < FRAMES; i++) {
        long long size = layout->sizes[i], item = ITEM_SIZES[i - 1];
        if (fields->big_tokens == NULL && fields->tokens <= LLONG_MAX / item
                && size == fields->tokens * item)
            continue;
        const char *name = ARRAY_NAMES[i - 1];
        if (fields->big_tokens != NULL)
            return reject("length", PyUnicode_FromFormat("%s: %lld bytes for %S tokens", name,
                                                         size, fields->big_tokens));
        return reject("length", PyUnicode_FromFormat("%s: %lld bytes for %lld tokens", name,
                                                     size, fields->tokens));
    }
    for (Py_ssize_t i = 0; i < fields->num_extras; i++) { /* check_extra_sizes */
        const Extra *extra = &fields->extras[i];
        long long size = layout->sizes[FRAMES + i];
        if (!extra->too_big && size == extra->nbytes)
            continue;
        return reject("length", PyUnicode_FromFormat("extra %R: %lld bytes for shape %R of %U",
                                                     extra->name, size, extra->shape,
                                                     extra->dtype));
    }
    return 0;
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

/* Everything after the size check, on the payload's bytes. */
static PyObject *check_payload(const unsigned char *data, Py_ssize_t size, PyObject *loads,
                               PyObject *schema) {
    Layout layout = {0};
    if (walk(data, size, &layout) < 0)
        return NULL;
    if (layout.count < FRAMES) {
        reject("frames", PyUnicode_FromFormat("expected %d frames, got %u", FRAMES,
                                              layout.count));
        return NULL;
    }
    PyObject *text = PyBytes_FromStringAndSize((const char *)data + layout.offsets[0],
                                               layout.sizes[0]);
    if (text == NULL)
        return NULL;
    PyObject *header = PyObject_CallFunctionObjArgs(loads, text, NULL);
    Py_DECREF(text);
    if (header == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) /* orjson.JSONDecodeError is one */
            return NULL;
        PyObject *message = pop_error_text();
        if (message != NULL)
            reject("header", PyUnicode_FromFormat("header is not JSON: %U", message));
        Py_XDECREF(message);
        return NULL;
    }
    Fields fields = {0};
    PyObject *run_id = NULL, *result = NULL;
    if (check_header(header, schema, &fields, &run_id) == 0 && check_count(&layout, &fields) == 0
            && check_sizes(&layout, &fields) == 0) {
        long min_version = -1;
        const char *reason = NULL;
        scan_tokens(data + layout.offsets[2], data + layout.offsets[3], data + layout.offsets[4],
                    (Py_ssize_t)layout.sizes[3], &min_version, &reason);
        result = Py_BuildValue("(nOlz)", size, run_id, min_version, reason);
    }
    Py_DECREF(header);
    Py_XDECREF(run_id);
    Py_XDECREF(fields.big_tokens);
    return result;
}

static PyObject *check(PyObject *module, PyObject *args) {
    PyObject *packed, *loads, *schema;
    Py_ssize_t max_bytes;
    if (!PyArg_ParseTuple(args, "OOOn:check", &packed, &loads, &schema, &max_bytes))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(packed, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    if (max_bytes >= 0 && view.len > max_bytes)
        reject("oversized", PyUnicode_FromFormat("%zd bytes > max_message_bytes %zd", view.len,
                                                 max_bytes));
    else
        result = check_payload((const unsigned char *)view.buf, view.len, loads, schema);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS,
     "check(packed, loads, schema, max_bytes) -> (nbytes, run_id, min_version, value_reason); "
     "raises GroupError(reason, detail): see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_groupscan",
    "The broker's check of a packed trajectory group, in C (see buffers.group_check).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__groupscan(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (GroupError == NULL) {
        GroupError = PyErr_NewException("buffers._groupscan.GroupError", PyExc_ValueError, NULL);
        if (GroupError == NULL) {
            Py_DECREF(module);
            return NULL;
        }
    }
    /* buffers.group_check compares it with asyncrl.wire's: an extension built before extras
     * existed (an install not redone after a pull) is not used. */
    if (PyModule_AddIntConstant(module, "MAX_EXTRAS", MAX_EXTRAS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(GroupError);
    if (PyModule_AddObject(module, "GroupError", GroupError) < 0) {
        Py_DECREF(GroupError);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
