# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The capture's hot path compiled: COPY messages read through psycopg2's own libpq, and pgoutput row changes
decoded straight into Avro keys and envelopes (lib/capture/native.py builds and selects it).

Every function here either returns exactly the bytes the Python path (lib/capture/events.py) gives, or None, and
the caller then takes the Python path for that message, which also names any error. It never reports a position
to the server: lib/capture/replication.py does, with what Kafka acknowledged.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.ref cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

cdef extern from "Python.h":
    double PyOS_string_to_double(const char *s, char **endptr, PyObject *overflow_exception)
    int PyFloat_Pack4(double x, char *p, int le)
    int PyFloat_Pack8(double x, char *p, int le)

cdef extern from *:
    """
    typedef __int128 cdc_i128;
    typedef unsigned __int128 cdc_u128;
    """
    ctypedef long long cdc_i128
    ctypedef unsigned long long cdc_u128

# column codes (lib/capture/native.py classifies the plan's columns)
cdef enum:
    GENERIC = 0
    STRING = 1
    BOOL = 2
    INT = 3
    LONG = 4
    FLOAT = 5
    DOUBLE = 6
    DATE = 7
    TIMESTAMP = 8
    TIMESTAMPTZ = 9
    TIME = 10
    DECIMAL = 11
    BYTEA = 12
    TEXT_ARRAY = 13

cdef int64_t INT64_MAX = 9223372036854775807

ctypedef int (*get_copy_data_t)(void *conn, char **buffer, int async_) noexcept nogil
ctypedef void (*free_mem_t)(void *ptr) noexcept nogil
ctypedef int (*consume_input_t)(void *conn) noexcept nogil


# ---------------------------------------------------------------------------------------------
# reading the COPY stream


cdef inline uint64_t _u64(const uint8_t *p) noexcept nogil:
    return ((<uint64_t>p[0] << 56) | (<uint64_t>p[1] << 48) | (<uint64_t>p[2] << 40) | (<uint64_t>p[3] << 32)
            | (<uint64_t>p[4] << 24) | (<uint64_t>p[5] << 16) | (<uint64_t>p[6] << 8) | <uint64_t>p[7])


cdef class CopyReader:
    """Reads XLogData messages in batches from a started replication connection (libpq functions given by address).

    read(n) gives up to n (data start, payload, WAL end) tuples and a status: 0, or -1 (the server ended the COPY
    stream) or -2 (libpq failed), reported once the batch is empty. A batch ends at a keepalive: its WAL end is
    in keepalive_end and reply is set when the server asked for a status message.
    """

    cdef void *conn
    cdef get_copy_data_t get_copy_data
    cdef free_mem_t free_mem
    cdef consume_input_t consume_input
    cdef public uint64_t keepalive_end
    cdef public bint reply
    cdef public int unexpected  # the message type byte of an unknown message, when status is -3

    def __init__(self, size_t conn, size_t get_copy_data, size_t free_mem, size_t consume_input):
        if not (conn and get_copy_data and free_mem and consume_input):
            raise ValueError("CopyReader needs a libpq connection and the addresses of its functions")
        self.conn = <void *>conn
        self.get_copy_data = <get_copy_data_t>get_copy_data
        self.free_mem = <free_mem_t>free_mem
        self.consume_input = <consume_input_t>consume_input
        self.keepalive_end = 0
        self.reply = False
        self.unexpected = 0

    def read(self, int limit):
        """([(data start, payload, WAL end)], status) with at most limit messages."""
        cdef list batch = []
        cdef char *buf = NULL
        cdef int size
        cdef bint consumed = False
        cdef const uint8_t *p
        cdef uint64_t end
        while len(batch) < limit:
            size = self.get_copy_data(self.conn, &buf, 1)
            if size > 0:
                p = <const uint8_t *>buf
                if p[0] == 0x77 and size >= 25:  # 'w' XLogData: start, WAL end, send time, payload
                    end = _u64(p + 9)
                    batch.append((_u64(p + 1), PyBytes_FromStringAndSize(buf + 25, size - 25), end))
                    self.free_mem(buf)
                    continue
                if p[0] == 0x6B and size >= 18:  # 'k' keepalive: WAL end, send time, reply requested
                    end = _u64(p + 1)
                    if end > self.keepalive_end:
                        self.keepalive_end = end
                    if p[17]:
                        self.reply = True
                    self.free_mem(buf)
                    return batch, 0
                self.unexpected = p[0]
                self.free_mem(buf)
                return batch, -3
            if size == 0:
                if consumed:
                    break
                if not self.consume_input(self.conn):
                    return batch, -2
                consumed = True
                continue
            return batch, (-1 if size == -1 else -2)
        return batch, 0


# ---------------------------------------------------------------------------------------------
# a growing byte buffer


cdef struct Buf:
    char *p
    Py_ssize_t n
    Py_ssize_t cap


cdef int _grow(Buf *b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap = b.cap if b.cap else 1024
    cdef char *p
    while cap < b.n + extra:
        cap *= 2
    p = <char *>realloc(b.p, cap)
    if p == NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline int _put(Buf *b, const char *s, Py_ssize_t n) except -1:
    if b.n + n > b.cap:
        _grow(b, n)
    memcpy(b.p + b.n, s, n)
    b.n += n
    return 0


cdef inline int _byte(Buf *b, char c) except -1:
    if b.n + 1 > b.cap:
        _grow(b, 1)
    b.p[b.n] = c
    b.n += 1
    return 0


cdef inline int _varint(Buf *b, uint64_t z) except -1:
    if b.n + 10 > b.cap:
        _grow(b, 10)
    while z >= 0x80:
        b.p[b.n] = <char>((z & 0x7F) | 0x80)
        b.n += 1
        z >>= 7
    b.p[b.n] = <char>z
    b.n += 1
    return 0


cdef inline int _long(Buf *b, int64_t v) except -1:
    """Avro long (and int): zig-zag varint."""
    return _varint(b, (<uint64_t>v << 1) ^ <uint64_t>(v >> 63))


cdef inline int _bytes_obj(Buf *b, bytes value) except -1:
    return _put(b, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))


# ---------------------------------------------------------------------------------------------
# text forms of the capture session (pgtypes.SESSION_SETTINGS) -> Avro


cdef inline bint _digit(char c) noexcept nogil:
    return b'0' <= c <= b'9'


cdef inline int _num(const char *s, int n) noexcept nogil:
    """n ASCII digits as an int (the caller checked them)."""
    cdef int v = 0
    cdef int i
    for i in range(n):
        v = v * 10 + (s[i] - 48)
    return v


cdef inline bint _digits(const char *s, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        if not _digit(s[i]):
            return False
    return True


cdef inline bint _ascii(const char *s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef unsigned char acc = 0
    for i in range(n):
        acc |= <unsigned char>s[i]
    return acc < 0x80


cdef int _utf8_ok(const char *s, Py_ssize_t n):
    """1 when s is UTF-8 as Python's bytes.decode() takes it, else 0."""
    if _ascii(s, n):
        return 1
    try:
        PyUnicode_DecodeUTF8(s, n, NULL)
    except UnicodeDecodeError:
        return 0
    return 1


cdef int _days_in_month(int y, int m) noexcept nogil:
    if m == 2:
        return 29 if (y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)) else 28
    if m == 4 or m == 6 or m == 9 or m == 11:
        return 30
    return 31


cdef int64_t _days_from_civil(int64_t y, int m, int d) noexcept nogil:
    """Days since 1970-01-01 of a proleptic Gregorian date (pgtypes.days_from_civil)."""
    cdef int64_t era, yoe, doy, doe
    y -= m <= 2
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


cdef int _plain_date(const char *s, int64_t *days) noexcept nogil:
    """'YYYY-MM-DD' (years 1-9999) -> days since 1970; -1 for any other form."""
    cdef int y, m, d
    if not (_digits(s, 4) and s[4] == b'-' and _digits(s + 5, 2) and s[7] == b'-' and _digits(s + 8, 2)):
        return -1
    y, m, d = _num(s, 4), _num(s + 5, 2), _num(s + 8, 2)
    if y < 1 or m < 1 or m > 12 or d < 1 or d > _days_in_month(y, m):
        return -1
    days[0] = _days_from_civil(y, m, d)
    return 0


cdef int _fraction(const char *s, int n, int64_t *micros) noexcept nogil:
    """'.f' to '.ffffff' -> microseconds; -1 otherwise."""
    cdef int i
    cdef int64_t v = 0
    if n < 2 or n > 7 or s[0] != b'.' or not _digits(s + 1, n - 1):
        return -1
    for i in range(1, 7):
        v = v * 10 + ((s[i] - 48) if i < n else 0)
    micros[0] = v
    return 0


cdef int _timestamp(const char *s, Py_ssize_t n, bint zone, int64_t *out) noexcept nogil:
    """'YYYY-MM-DD HH:MM:SS[.ffffff]' (with '+00' for timestamptz) -> microseconds since 1970; -1 otherwise."""
    cdef int64_t days = 0, frac = 0
    if zone:
        if n < 3 or s[n - 3] != b'+' or s[n - 2] != b'0' or s[n - 1] != b'0':
            return -1
        n -= 3
    if n < 19 or s[10] != b' ' or _plain_date(s, &days) < 0:
        return -1
    if not (_digits(s + 11, 2) and s[13] == b':' and _digits(s + 14, 2) and s[16] == b':' and _digits(s + 17, 2)):
        return -1
    if n > 19 and _fraction(s + 19, <int>(n - 19), &frac) < 0:
        return -1
    out[0] = (days * 86400 + _num(s + 11, 2) * 3600 + _num(s + 14, 2) * 60 + _num(s + 17, 2)) * 1000000 + frac
    return 0


cdef int _time(const char *s, Py_ssize_t n, int64_t *out) noexcept nogil:
    """'HH:MM:SS[.ffffff]' -> microseconds; -1 otherwise."""
    cdef int64_t frac = 0
    if n < 8 or not (_digits(s, 2) and s[2] == b':' and _digits(s + 3, 2) and s[5] == b':' and _digits(s + 6, 2)):
        return -1
    if n > 8 and _fraction(s + 8, <int>(n - 8), &frac) < 0:
        return -1
    out[0] = (_num(s, 2) * 3600 + _num(s + 3, 2) * 60 + _num(s + 6, 2)) * <int64_t>1000000 + frac
    return 0


cdef int _integer(const char *s, Py_ssize_t n, int64_t *out) noexcept nogil:
    """'-?[0-9]+' within 64 bits -> the value; -1 otherwise."""
    cdef Py_ssize_t i = 0
    cdef uint64_t acc = 0
    cdef bint negative = n > 0 and s[0] == b'-'
    if negative:
        i = 1
    if n - i < 1 or n - i > 19:
        return -1
    while i < n:
        if not _digit(s[i]):
            return -1
        acc = acc * 10 + <uint64_t>(s[i] - 48)
        i += 1
    if negative:
        if acc > <uint64_t>INT64_MAX + 1:
            return -1
        out[0] = <int64_t>(0 - acc)
    else:
        if acc > <uint64_t>INT64_MAX:
            return -1
        out[0] = <int64_t>acc
    return 0


cdef int _decimal(Buf *b, const char *s, Py_ssize_t n, int precision, int scale) except -2:
    """numeric text -> Avro decimal(precision, scale) bytes as decimal_encoder writes them; -1 when not handled."""
    cdef Py_ssize_t i = 0, frac_len = 0, coefficient_len = 0
    cdef bint negative = n > 0 and s[0] == b'-'
    cdef bint seen_point = False, significant = False
    cdef cdc_u128 magnitude = 0
    cdef cdc_i128 value
    cdef int bits = 0, size, k
    cdef char raw[17]
    if negative:
        i = 1
    if i >= n:
        return -1
    while i < n:
        if s[i] == b'.':
            if seen_point:
                return -1
            seen_point = True
        elif _digit(s[i]):
            if seen_point:
                frac_len += 1
            if s[i] != b'0':
                significant = True
            if significant:
                coefficient_len += 1
                if coefficient_len > 38:
                    return -1
                magnitude = magnitude * 10 + <cdc_u128>(s[i] - 48)
        else:
            return -1
        i += 1
    if frac_len > scale or (coefficient_len if coefficient_len else 1) > precision:
        return -1  # the Python path raises, naming the column
    if coefficient_len + (scale - frac_len) > 38:
        return -1
    for k in range(scale - frac_len):
        magnitude *= 10
    value = <cdc_i128>magnitude
    if negative:
        value = -value
    while bits < 128 and (magnitude >> bits) != 0:
        bits += 1
    size = (bits + 8) // 8
    for k in range(size):
        raw[size - 1 - k] = <char>((value >> (8 * k)) & 0xFF)
    _long(b, size)
    _put(b, raw, size)
    return 0


cdef inline int _hex(char c) noexcept nogil:
    if b'0' <= c <= b'9':
        return c - 48
    if b'a' <= c <= b'f':
        return c - 87
    if b'A' <= c <= b'F':
        return c - 55
    return -1


cdef int _bytea(Buf *b, const char *s, Py_ssize_t n) except -2:
    """'\\x0102ff' -> Avro bytes; -1 for the escape form."""
    cdef Py_ssize_t i, count
    cdef int hi, lo
    if n < 2 or s[0] != b'\\' or s[1] != b'x' or (n - 2) % 2:
        return -1
    count = (n - 2) // 2
    _long(b, count)
    if b.n + count > b.cap:
        _grow(b, count)
    for i in range(count):
        hi, lo = _hex(s[2 + 2 * i]), _hex(s[3 + 2 * i])
        if hi < 0 or lo < 0:
            return -1
        b.p[b.n + i] = <char>(hi * 16 + lo)
    b.n += count
    return 0


cdef int _text_array(Buf *b, const char *s, Py_ssize_t n) except -2:
    """'{a,NULL,b}' (no quotes, no escapes, one dimension) -> Avro array of [null, string]; -1 otherwise."""
    cdef Py_ssize_t i, start, count = 1
    if n < 2 or s[0] != b'{' or s[n - 1] != b'}':
        return -1
    if n == 2:
        return _byte(b, 0)
    if s[1] == b'{':
        return -1
    for i in range(1, n - 1):
        if s[i] == b'"' or s[i] == b'\\':
            return -1
        if s[i] == b',':
            count += 1
    _long(b, count)
    start = 1
    for i in range(1, n):
        if s[i] == b',' or i == n - 1:
            if i - start == 4 and s[start] == b'N' and s[start + 1] == b'U' and s[start + 2] == b'L' \
                    and s[start + 3] == b'L':
                _byte(b, 0)
            else:
                _byte(b, 2)
                _long(b, i - start)
                _put(b, s + start, i - start)
            start = i + 1
    return _byte(b, 0)


# ---------------------------------------------------------------------------------------------
# rows and events


cdef struct Row:
    Buf buf  # the Value record's fields, each with its union branch
    Py_ssize_t *start  # per column: where its value (without the union branch) starts in buf, -1 when absent
    Py_ssize_t *end
    char *state  # per column: 0 value, 1 null, 2 unchanged TOASTed value
    int unchanged


cdef void _free_row(Row *row) noexcept:
    free(row.start)
    free(row.end)
    free(row.state)
    free(row.buf.p)


cdef class RowCodec:
    """One table version's row changes -> wire-format (key, value) pairs, as events.encoded_events makes them."""

    cdef int ncols, nkeys
    cdef int *codes
    cdef char *nullable
    cdef int *precision
    cdef int *scale
    cdef int *key_index
    cdef bint float_key
    cdef tuple convs, encoders, names
    cdef bytes key_prefix, value_prefix
    cdef Row new, old
    cdef Buf key, other_key, out

    def __cinit__(self):
        self.codes = self.precision = self.scale = self.key_index = NULL
        self.nullable = NULL
        self.new.start = self.new.end = self.old.start = self.old.end = NULL
        self.new.state = self.old.state = NULL

    def __init__(self, codes, nullable, precision, scale, convs, encoders, names, key_index, bint float_key,
                 bytes key_prefix, bytes value_prefix):
        cdef int i
        self.ncols = len(codes)
        self.nkeys = len(key_index)
        if not (len(nullable) == len(precision) == len(scale) == len(convs) == len(encoders) == len(names)
                == self.ncols) or self.nkeys == 0:
            raise ValueError("RowCodec: one entry per column, and at least one key column")
        self.codes = <int *>realloc(NULL, sizeof(int) * self.ncols)
        self.precision = <int *>realloc(NULL, sizeof(int) * self.ncols)
        self.scale = <int *>realloc(NULL, sizeof(int) * self.ncols)
        self.nullable = <char *>realloc(NULL, self.ncols)
        self.key_index = <int *>realloc(NULL, sizeof(int) * self.nkeys)
        self.new.start = <Py_ssize_t *>realloc(NULL, sizeof(Py_ssize_t) * self.ncols)
        self.new.end = <Py_ssize_t *>realloc(NULL, sizeof(Py_ssize_t) * self.ncols)
        self.new.state = <char *>realloc(NULL, self.ncols)
        self.old.start = <Py_ssize_t *>realloc(NULL, sizeof(Py_ssize_t) * self.ncols)
        self.old.end = <Py_ssize_t *>realloc(NULL, sizeof(Py_ssize_t) * self.ncols)
        self.old.state = <char *>realloc(NULL, self.ncols)
        if not (self.codes and self.precision and self.scale and self.nullable and self.key_index
                and self.new.start and self.new.end and self.new.state and self.old.start and self.old.end
                and self.old.state):
            raise MemoryError()
        for i in range(self.ncols):
            self.codes[i] = codes[i]
            self.nullable[i] = 1 if nullable[i] else 0
            self.precision[i] = precision[i]
            self.scale[i] = scale[i]
        for i in range(self.nkeys):
            if not 0 <= key_index[i] < self.ncols:
                raise ValueError("RowCodec: key position out of range")
            self.key_index[i] = key_index[i]
        self.convs, self.encoders, self.names = tuple(convs), tuple(encoders), tuple(names)
        self.float_key = float_key
        self.key_prefix, self.value_prefix = key_prefix, value_prefix

    def __dealloc__(self):
        free(self.codes)
        free(self.precision)
        free(self.scale)
        free(self.nullable)
        free(self.key_index)
        _free_row(&self.new)
        _free_row(&self.old)
        free(self.key.p)
        free(self.other_key.p)
        free(self.out.p)

    cdef int _value(self, int i, Buf *b, const char *s, Py_ssize_t n) except -2:
        """One column's non-null text -> its Avro encoding (without the union branch); -1 defers."""
        cdef int code = self.codes[i]
        cdef int64_t v
        cdef double d
        cdef char *end = NULL
        cdef char tmp[64]
        cdef char packed[8]
        cdef Py_ssize_t mark = b.n
        if code == STRING:
            if not _utf8_ok(s, n):
                return -1
            _long(b, n)
            return _put(b, s, n)
        if code == INT or code == LONG:
            if _integer(s, n, &v) == 0 and (code == LONG or -2147483648 <= v <= 2147483647):
                return _long(b, v)
        elif code == DATE:
            if n == 10 and _plain_date(s, &v) == 0:
                return _long(b, v)
        elif code == TIMESTAMP or code == TIMESTAMPTZ:
            if n <= 29 and _timestamp(s, n, code == TIMESTAMPTZ, &v) == 0:
                return _long(b, v)
        elif code == DECIMAL:
            if _decimal(b, s, n, self.precision[i], self.scale[i]) == 0:
                return 0
        elif code == BOOL:
            if n == 1 and s[0] == b't':
                return _byte(b, 1)
            if n == 1 and s[0] == b'f':
                return _byte(b, 0)
        elif code == FLOAT or code == DOUBLE:
            if 0 < n < 63:
                memcpy(tmp, s, n)
                tmp[n] = 0
                d = PyOS_string_to_double(tmp, &end, NULL)
                if PyErr_Occurred():
                    PyErr_Clear()
                elif end == tmp + n:
                    if code == DOUBLE:
                        PyFloat_Pack8(d, packed, 1)
                        return _put(b, packed, 8)
                    if PyFloat_Pack4(d, packed, 1) == 0:
                        return _put(b, packed, 4)
                    PyErr_Clear()
                    return -1  # too large for a float: the Python path names the column
        elif code == TIME:
            if _time(s, n, &v) == 0:
                return _long(b, v)
        elif code == BYTEA:
            if _bytea(b, s, n) == 0:
                return 0
        elif code == TEXT_ARRAY:
            if _utf8_ok(s, n) and _text_array(b, s, n) == 0:
                return 0
        b.n = mark  # a fast form that failed halfway leaves nothing behind
        return self._generic(i, b, s, n)

    cdef int _generic(self, int i, Buf *b, const char *s, Py_ssize_t n) except -2:
        """The column's Python converter and encoder (any other form or type); -1 when they fail."""
        try:
            text = PyUnicode_DecodeUTF8(s, n, NULL)
            convert = self.convs[i]
            encoded = (self.encoders[i])(text if convert is None else convert(text))
        except Exception:
            return -1
        if type(encoded) is not bytes:
            return -1
        return _bytes_obj(b, encoded)

    cdef int _tuple(self, const char *data, Py_ssize_t size, Py_ssize_t *pos, Row *row, bint old) except -2:
        """TupleData at pos into row; -1 defers."""
        cdef Py_ssize_t p = pos[0], length
        cdef int i, count
        cdef char kind
        cdef Buf *b = &row.buf
        b.n = 0
        row.unchanged = 0
        if p + 2 > size:
            return -1
        count = <short>((<uint8_t>data[p] << 8) | <uint8_t>data[p + 1])
        if count != self.ncols:
            return -1
        p += 2
        for i in range(count):
            if p >= size:
                return -1
            kind = data[p]
            if kind == b't':
                if p + 5 > size:
                    return -1
                length = <int>((<uint64_t><uint8_t>data[p + 1] << 24) | (<uint8_t>data[p + 2] << 16)
                               | (<uint8_t>data[p + 3] << 8) | <uint8_t>data[p + 4])
                p += 5
                if length < 0 or p + length > size:
                    return -1
                if self.nullable[i]:
                    _byte(b, 2)
                row.start[i] = b.n
                if self._value(i, b, data + p, length) < 0:
                    return -1
                row.end[i] = b.n
                row.state[i] = 0
                p += length
            elif kind == b'n' or kind == b'u':
                if not self.nullable[i]:
                    return -1
                _byte(b, 0)
                row.start[i] = row.end[i] = -1
                if kind == b'u' and not old:
                    row.state[i] = 2
                    row.unchanged += 1
                else:
                    row.state[i] = 1
                p += 1
            else:
                return -1
        pos[0] = p
        return 0

    cdef int _key(self, Buf *k, Row *row, Row *fallback) except -2:
        """The key (Confluent framing + key record) from row, key values missing there taken from fallback."""
        cdef int j, i
        cdef Row *src
        k.n = 0
        _bytes_obj(k, self.key_prefix)
        for j in range(self.nkeys):
            i = self.key_index[j]
            src = row
            if row.state[i] != 0:
                if fallback == NULL or fallback.state[i] != 0:
                    return -1  # a NULL or unchanged key value: the Python path names it
                src = fallback
            _put(k, src.buf.p + src.start[i], src.end[i] - src.start[i])
        return 0

    cdef bytes _envelope(self, char op, Row *before, Row *after, tuple parts, object prev, int64_t lsn,
                         int64_t serial):
        """The envelope's wire bytes (Plan.value_bytes)."""
        cdef Buf *b = &self.out
        cdef char sequence[64]
        cdef int length, i
        b.n = 0
        _bytes_obj(b, self.value_prefix)
        if before == NULL:
            _byte(b, 0)
        else:
            _byte(b, 2)
            _put(b, before.buf.p, before.buf.n)
        if after == NULL:
            _byte(b, 0)
        else:
            _byte(b, 2)
            _put(b, after.buf.p, after.buf.n)
        _bytes_obj(b, <bytes>parts[0])
        if prev is None:
            length = snprintf(sequence, 64, b'[null,"%lld"]', <long long>lsn)
        else:
            length = snprintf(sequence, 64, b'["%llu","%lld"]', <unsigned long long>prev, <long long>lsn)
        _byte(b, 2)
        _long(b, length)
        _put(b, sequence, length)
        _bytes_obj(b, <bytes>parts[1])
        _byte(b, 2)
        _long(b, lsn)
        _bytes_obj(b, <bytes>parts[2])
        _long(b, serial)
        _byte(b, 2)
        _byte(b, op)
        _bytes_obj(b, <bytes>parts[3])
        if after != NULL and after.unchanged:
            _long(b, after.unchanged)
            for i in range(self.ncols):
                if after.state[i] == 2:
                    _bytes_obj(b, <bytes>self.names[i])
        _byte(b, 0)
        return PyBytes_FromStringAndSize(b.p, b.n)

    def events(self, bytes payload, Py_ssize_t pos, uint64_t lsn, tuple parts, prev, uint64_t commit_lsn,
               int64_t serial):
        """(pairs, next serial) for an Insert/Update/Delete whose relation id is at pos, or None (Python path).

        parts: Plan._source_parts(tx); prev: the previous commit's LSN or None; a tombstone's value is its headers.
        """
        cdef const char *data = PyBytes_AS_STRING(payload)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(payload)
        cdef Py_ssize_t p = pos + 4
        cdef char kind, marker
        cdef bint has_old = False
        cdef bytes key, old_key
        if lsn > <uint64_t>INT64_MAX or commit_lsn > <uint64_t>INT64_MAX or size < pos + 5 or serial < 0 \
                or serial > INT64_MAX - 2:
            return None
        if prev is not None and not 0 <= prev <= 0xFFFFFFFFFFFFFFFF:
            return None
        kind = data[0]
        marker = data[p]
        if kind == b'I':
            if marker != b'N':
                return None
            p += 1
            if self._tuple(data, size, &p, &self.new, False) < 0 or p != size:
                return None
            if self._key(&self.key, &self.new, NULL) < 0:
                return None
            key = PyBytes_FromStringAndSize(self.key.p, self.key.n)
            return [(key, self._envelope(b'c', NULL, &self.new, parts, prev, lsn, serial))], serial + 1
        if kind == b'U':
            if marker == b'K' or marker == b'O':
                p += 1
                if self._tuple(data, size, &p, &self.old, True) < 0 or p >= size:
                    return None
                has_old = True
                if data[p] != b'N':
                    return None
            elif marker != b'N':
                return None
            p += 1
            if self._tuple(data, size, &p, &self.new, False) < 0 or p != size:
                return None
            if not has_old:
                if self._key(&self.key, &self.new, NULL) < 0:
                    return None
                key = PyBytes_FromStringAndSize(self.key.p, self.key.n)
                return [(key, self._envelope(b'u', NULL, &self.new, parts, prev, lsn, serial))], serial + 1
            if self.float_key:
                return None  # 0.0 == -0.0 and NaN != NaN: key equality is the Python path's
            if self._key(&self.other_key, &self.old, NULL) < 0 or self._key(&self.key, &self.new, &self.old) < 0:
                return None
            old_key = PyBytes_FromStringAndSize(self.other_key.p, self.other_key.n)
            key = PyBytes_FromStringAndSize(self.key.p, self.key.n)
            if key != old_key:  # the primary key changed: d + tombstone for the old key, c for the new one
                return [(old_key, self._envelope(b'd', &self.old, NULL, parts, prev, lsn, serial)),
                        (old_key, _tombstone(commit_lsn, serial)),
                        (key, self._envelope(b'c', NULL, &self.new, parts, prev, lsn, serial + 1))], serial + 2
            return [(key, self._envelope(b'u', &self.old if marker == b'O' else NULL, &self.new, parts, prev, lsn,
                                         serial))], serial + 1
        if kind == b'D':
            if marker != b'K' and marker != b'O':
                return None
            p += 1
            if self._tuple(data, size, &p, &self.old, True) < 0 or p != size:
                return None
            if self._key(&self.key, &self.old, NULL) < 0:
                return None
            key = PyBytes_FromStringAndSize(self.key.p, self.key.n)
            return [(key, self._envelope(b'd', &self.old, NULL, parts, prev, lsn, serial)),
                    (key, _tombstone(commit_lsn, serial))], serial + 1
        return None


POSITION_HEADER = "cdc.position"


cdef list _tombstone(uint64_t commit_lsn, int64_t serial):
    """events.tombstone_headers(commit_lsn, serial)."""
    cdef char raw[16]
    cdef int k
    for k in range(8):
        raw[7 - k] = <char>((commit_lsn >> (8 * k)) & 0xFF)
        raw[15 - k] = <char>((<uint64_t>serial >> (8 * k)) & 0xFF)
    return [(POSITION_HEADER, PyBytes_FromStringAndSize(raw, 16))]
