/*
 * aiowsync._copy._stream: copies that write around the CPU caches.
 *
 * A staging copy writes a slot that this process will not read again: the workers map it and
 * read it from memory. An ordinary store first reads every destination cache line it is about
 * to overwrite (the line must be owned before it is written), so a copy moves three bytes over
 * the memory bus for each byte copied. Non-temporal stores write whole lines straight to
 * memory and skip that read, which makes staging copies markedly faster (docs/adr/0049;
 * the figures are on docs/benchmarks.md).
 *
 * One call copies a list of moves, packed as native unsigned 64-bit integers, three per move:
 * destination address, source address, byte count. The interpreter lock is released for the
 * whole list, and the call returns only once every store is visible to other CPUs (sfence).
 * Moves shorter than STREAM_MIN_BYTES, and the unaligned head and the partial last line of
 * longer ones, are plain memcpy calls. Where the compiler targets no x86-64 CPU, every move
 * is a plain memcpy and STREAMS is False: the callers then keep their own copy paths.
 *
 * The caller guarantees that every address is valid for its byte count and that the
 * destination ranges do not overlap the sources; nothing here can check a raw address.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define AIOWSYNC_STREAMS 1
#else
#define AIOWSYNC_STREAMS 0
#endif

/* Shorter moves gain nothing from streaming (and a later reader in this process would find
 * them out of cache). */
#define STREAM_MIN_BYTES 4096

static void copy_move(char *dst, const char *src, size_t n)
{
#if AIOWSYNC_STREAMS
    if (n >= STREAM_MIN_BYTES) {
        size_t head = (size_t)(-(uintptr_t)dst & 15u);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}

PyDoc_STRVAR(copy_moves_doc,
"copy_moves(moves, /)\n--\n\n"
"Copy every (dst, src, nbytes) move packed in the buffer ``moves`` (native uint64, three\n"
"per move), releasing the interpreter lock, with non-temporal stores where STREAMS.");

static PyObject *copy_moves(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    (void)module;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const size_t triple = 3 * sizeof(uint64_t);
    if (view.len < 0 || (size_t)view.len % triple != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError,
                        "moves must hold whole (dst, src, nbytes) triples of uint64");
        return NULL;
    }
    const char *packed = (const char *)view.buf;
    const size_t count = (size_t)view.len / triple;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < count; i++) {
        uint64_t move[3];
        memcpy(move, packed + i * triple, triple); /* the buffer need not be aligned */
        copy_move((char *)(uintptr_t)move[0], (const char *)(uintptr_t)move[1],
                  (size_t)move[2]);
    }
#if AIOWSYNC_STREAMS
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef stream_methods[] = {
    {"copy_moves", copy_moves, METH_O, copy_moves_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef stream_module = {
    PyModuleDef_HEAD_INIT,
    "aiowsync._copy._stream",
    "Copies with non-temporal stores (see the comment at the top of _stream.c).",
    -1,
    stream_methods,
};

PyMODINIT_FUNC PyInit__stream(void)
{
    PyObject *module = PyModule_Create(&stream_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "STREAMS", AIOWSYNC_STREAMS ? Py_True : Py_False) < 0 ||
        PyModule_AddIntConstant(module, "STREAM_MIN_BYTES", STREAM_MIN_BYTES) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
