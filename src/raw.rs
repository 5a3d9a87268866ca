//! Raw jsonb and array arguments.
//!
//! pgrx's `JsonB` turns every value into a `serde_json::Value` (jsonb_out, parse, and back again on
//! the way out). `raise` only needs to know that a payload is an object and to hand the very same
//! datum to the INSERT, so these types keep the datum as Postgres gave it.

use pg_outbox_core::filter::Scalar;
use pgrx::callconv::{Arg, ArgAbi};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::FromDatum;

macro_rules! raw_datum_type {
    ($(#[$doc:meta])* $name:ident, $sql:literal, $oid:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub struct $name(pub pg_sys::Datum);

        impl FromDatum for $name {
            unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Self> {
                (!is_null).then_some($name(datum))
            }
        }

        impl pgrx::IntoDatum for $name {
            fn into_datum(self) -> Option<pg_sys::Datum> {
                Some(self.0)
            }
            fn type_oid() -> pg_sys::Oid {
                $oid
            }
        }

        // SAFETY: the datum is only ever read as the SQL type declared below.
        unsafe impl<'fcx> ArgAbi<'fcx> for $name {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                // SAFETY: the caller guarantees the argument has the declared SQL type.
                unsafe { arg.unbox_arg_using_from_datum() }
                    .unwrap_or_else(|| panic!("argument {index} must not be null"))
            }
        }

        // SAFETY: the SQL type named here is what the functions declare and what the datum is.
        unsafe impl SqlTranslatable for $name {
            const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!($name);
            const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
            const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> = Ok(SqlMappingRef::literal($sql));
            const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
                Ok(ReturnsRef::One(SqlMappingRef::literal($sql)));
        }
    };
}

raw_datum_type!(
    /// A `jsonb` argument, untouched.
    RawJsonb, "jsonb", pg_sys::JSONBOID
);
raw_datum_type!(
    /// A `jsonb[]` argument, untouched.
    RawJsonbArray, "jsonb[]", pg_sys::JSONBARRAYOID
);
raw_datum_type!(
    /// A `text[]` argument, untouched.
    RawTextArray, "text[]", pg_sys::TEXTARRAYOID
);

raw_datum_type!(
    /// A `regprocedure` argument: a function oid, resolved from its signature by the caller's cast.
    RawRegprocedure, "regprocedure", pg_sys::REGPROCEDUREOID
);

raw_datum_type!(
    /// A `regrole` argument: a role oid, resolved from its name by the caller's cast.
    RawRegrole, "regrole", pg_sys::REGROLEOID
);

raw_datum_type!(
    /// A `time` argument, passed through as it came: pgrx's `Time` wraps 24:00 (which `time`
    /// accepts) to 00:00, and the SQL that checks it must see 24:00 to refuse it.
    RawTime, "time", pg_sys::TIMEOID
);

raw_datum_type!(
    /// A `timestamp` argument (a local date and time), passed through as it came.
    RawTimestamp, "timestamp", pg_sys::TIMESTAMPOID
);

impl RawTimestamp {
    pub fn datum(self) -> DatumWithOid<'static> {
        // SAFETY: a timestamp datum (int8 microseconds, by value) typed as timestamp.
        unsafe { DatumWithOid::new(self.0, pg_sys::TIMESTAMPOID) }
    }
}

impl RawTime {
    pub fn datum(self) -> DatumWithOid<'static> {
        // SAFETY: a time datum (int8 microseconds, by value) typed as time.
        unsafe { DatumWithOid::new(self.0, pg_sys::TIMEOID) }
    }
}

impl RawRegrole {
    pub fn oid(self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.0.value() as u32)
    }
}

impl RawRegprocedure {
    pub fn oid(self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.0.value() as u32)
    }
}

impl RawJsonb {
    /// True when the value is a JSON object (not an array, scalar or null).
    pub fn is_object(self) -> bool {
        is_jsonb_object(self.0)
    }

    /// Its size uncompressed, in bytes (a compressed value is not decompressed to tell).
    pub fn raw_size(self) -> u64 {
        // SAFETY: the datum is a non-null jsonb varlena; toast_raw_datum_size reads its header.
        unsafe { pg_sys::toast_raw_datum_size(self.0) as u64 }
    }
}

fn is_jsonb_object(datum: pg_sys::Datum) -> bool {
    // SAFETY: the datum is a non-null jsonb; detoasting gives a readable varlena whose data starts
    // with the root container's 32-bit header, whose flag bits say object, array or scalar.
    unsafe {
        let v = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
        let header = pgrx::varlena::vardata_any(v).cast::<u32>().read_unaligned();
        header & pg_sys::JB_FOBJECT != 0
    }
}

/// The elements of a one-dimensional array, as (datum, is_null) pairs.
///
/// Refuses arrays of more than one dimension: `raise_many` pairs elements by index.
fn elements(
    array: pg_sys::Datum,
    elem_type: pg_sys::Oid,
    what: &str,
) -> Vec<Option<pg_sys::Datum>> {
    // SAFETY: the datum is a non-null array of elem_type (the SQL signature says so), a varlena
    // type (text or jsonb: length -1, by reference, int alignment); deconstruct_array pallocs the
    // outputs, which live until the end of the call.
    unsafe {
        let arr = pg_sys::pg_detoast_datum(array.cast_mut_ptr()).cast::<pg_sys::ArrayType>();
        if (*arr).ndim > 1 {
            crate::error::Error::Invalid(pg_outbox_core::Invalid::new(
                pg_outbox_core::InvalidKind::Parameter,
                format!("{what} must be a one-dimensional array"),
            ))
            .report();
        }
        let mut datums: *mut pg_sys::Datum = std::ptr::null_mut();
        let mut nulls: *mut bool = std::ptr::null_mut();
        let mut n: i32 = 0;
        pg_sys::deconstruct_array(
            arr,
            elem_type,
            -1,
            false,
            pg_sys::TYPALIGN_INT as std::ffi::c_char,
            &mut datums,
            &mut nulls,
            &mut n,
        );
        (0..n as usize)
            .map(|i| (!*nulls.add(i)).then(|| *datums.add(i)))
            .collect()
    }
}

impl RawJsonbArray {
    /// The elements (None for SQL NULL), each still a raw jsonb datum.
    pub fn elements(self, what: &str) -> Vec<Option<RawJsonb>> {
        elements(self.0, pg_sys::JSONBOID, what)
            .into_iter()
            .map(|d| d.map(RawJsonb))
            .collect()
    }
}

impl RawTextArray {
    /// The elements as strings (None for SQL NULL).
    pub fn strings(self, what: &str) -> Vec<Option<String>> {
        elements(self.0, pg_sys::TEXTOID, what)
            .into_iter()
            // SAFETY: each element is a non-null text datum.
            .map(|d| d.and_then(|d| unsafe { String::from_datum(d, false) }))
            .collect()
    }
}

/// What `RawJsonb::fields` read: each field found (its value, or why serde_json refused it), or,
/// of a value that is not an object, the whole value.
pub enum Fields {
    Of(Vec<(String, Result<serde_json::Value, String>)>),
    NotAnObject(Result<serde_json::Value, String>),
}

impl RawJsonb {
    /// The top-level fields `keys` of an object, as JSON (the ones it lacks are left out), read
    /// from the binary value: a filter that selects one field of a payload no longer has the whole
    /// payload printed and parsed per event. Each value is what printing the whole value and
    /// parsing it would give: strings as stored, numbers as `numeric_out` prints them parsed by
    /// serde_json, nested objects and arrays printed and parsed; a value serde_json refuses (a
    /// number out of its range, nesting past its recursion limit) is an error of that field alone.
    pub fn fields(self, keys: &[String]) -> Fields {
        // SAFETY: the datum is a non-null jsonb. Detoasted (and unpacked: the root container
        // must be aligned) into the current memory context; the JsonbValues found point into it,
        // and the text printed of nested values is palloc'd there too, all read before returning.
        unsafe {
            let jsonb = pg_sys::pg_detoast_datum(self.0.cast_mut_ptr()).cast::<pg_sys::Jsonb>();
            let root = std::ptr::addr_of_mut!((*jsonb).root);
            if (*root).header & pg_sys::JB_FOBJECT == 0 {
                return Fields::NotAnObject(container_json(root, 0));
            }
            let mut found = std::mem::MaybeUninit::<pg_sys::JsonbValue>::zeroed();
            let mut fields = Vec::with_capacity(keys.len());
            for key in keys {
                let v = pg_sys::getKeyJsonValueFromContainer(
                    root,
                    key.as_ptr().cast(),
                    key.len() as std::ffi::c_int,
                    found.as_mut_ptr(),
                );
                if !v.is_null() {
                    fields.push((key.clone(), scalar_or_container_json(&*v)));
                }
            }
            Fields::Of(fields)
        }
    }
}

impl RawJsonb {
    /// The top-level fields `keys` of an object as native filters read them
    /// (`pg_outbox_core::filter::native`), into `out`, one per key in order: absent, a scalar as
    /// `fields` would give it to CEL (numbers by the same printing and parsing), or `Other`
    /// (a nested value, a string that is not UTF-8). Of a value that is not an object, all
    /// `Other`.
    ///
    /// # Safety
    /// The strings borrow the value detoasted into the current memory context: `'a` ends before
    /// that context is reset or deleted.
    pub unsafe fn scalars<'a>(self, keys: &[String], out: &mut Vec<Scalar<'a>>) {
        out.clear();
        // SAFETY: the datum is a non-null jsonb, detoasted (aligned) into the current memory
        // context; the JsonbValues found point into it.
        unsafe {
            let jsonb = pg_sys::pg_detoast_datum(self.0.cast_mut_ptr()).cast::<pg_sys::Jsonb>();
            let root = std::ptr::addr_of_mut!((*jsonb).root);
            if (*root).header & pg_sys::JB_FOBJECT == 0 {
                out.extend(keys.iter().map(|_| Scalar::Other));
                return;
            }
            let mut found = std::mem::MaybeUninit::<pg_sys::JsonbValue>::zeroed();
            for key in keys {
                let v = pg_sys::getKeyJsonValueFromContainer(
                    root,
                    key.as_ptr().cast(),
                    key.len() as std::ffi::c_int,
                    found.as_mut_ptr(),
                );
                out.push(if v.is_null() {
                    Scalar::Absent
                } else {
                    scalar(&*v)
                });
            }
        }
    }
}

/// A JsonbValue as a native filter reads it.
///
/// # Safety
/// `v` is a value `getKeyJsonValueFromContainer` returned, its data alive for `'a`.
unsafe fn scalar<'a>(v: &pg_sys::JsonbValue) -> Scalar<'a> {
    use pg_sys::jbvType;
    // SAFETY: the union's member is the one `type_` says; strings point into the value.
    unsafe {
        match v.type_ {
            jbvType::jbvNull => Scalar::Null,
            jbvType::jbvBool => Scalar::Bool(v.val.boolean),
            jbvType::jbvString => {
                let bytes = std::slice::from_raw_parts::<'a, u8>(
                    v.val.string.val.cast::<u8>(),
                    v.val.string.len as usize,
                );
                std::str::from_utf8(bytes).map_or(Scalar::Other, Scalar::string)
            }
            jbvType::jbvNumeric => match small_integer(v.val.numeric) {
                Some(i) => Scalar::Int(i),
                None => match scalar_or_container_json(v) {
                    Ok(serde_json::Value::Number(n)) => Scalar::number(&n),
                    _ => Scalar::Other,
                },
            },
            _ => Scalar::Other,
        }
    }
}

impl RawJsonb {
    /// The whole value as JSON: printed as jsonb_out prints it, and parsed.
    pub fn whole(self) -> Result<serde_json::Value, String> {
        // SAFETY: the datum is a non-null jsonb, detoasted (aligned) into the current memory
        // context; its root container is printed there and read before returning.
        unsafe {
            let jsonb = pg_sys::pg_detoast_datum(self.0.cast_mut_ptr()).cast::<pg_sys::Jsonb>();
            container_json(
                std::ptr::addr_of_mut!((*jsonb).root),
                pgrx::varlena::varsize_any(jsonb.cast()) as std::ffi::c_int,
            )
        }
    }
}

/// A JsonbValue found in a container (a scalar, or a nested container), as JSON.
///
/// # Safety
/// `v` is a value `getKeyJsonValueFromContainer` returned, its data still alive.
unsafe fn scalar_or_container_json(v: &pg_sys::JsonbValue) -> Result<serde_json::Value, String> {
    use pg_sys::jbvType;
    Ok(match v.type_ {
        jbvType::jbvNull => serde_json::Value::Null,
        jbvType::jbvBool => serde_json::Value::Bool(v.val.boolean),
        jbvType::jbvString => {
            let bytes = std::slice::from_raw_parts(
                v.val.string.val.cast::<u8>(),
                v.val.string.len as usize,
            );
            serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned())
        }
        jbvType::jbvNumeric if small_integer(v.val.numeric).is_some() => {
            serde_json::Value::from(small_integer(v.val.numeric).expect("just read"))
        }
        jbvType::jbvNumeric => {
            let text = pgrx::direct_function_call_as_datum(
                pg_sys::numeric_out,
                &[Some(pg_sys::Datum::from(v.val.numeric))],
            )
            .expect("numeric_out returns text");
            let text = std::ffi::CStr::from_ptr(text.cast_mut_ptr::<std::ffi::c_char>());
            parse(&text.to_string_lossy())?
        }
        jbvType::jbvBinary => container_json(v.val.binary.data, v.val.binary.len)?,
        other => return Err(format!("unexpected jsonb value of type {other}")),
    })
}

/// The integer a numeric holds, read from its digits, when `numeric_out` would print it without
/// a decimal point (display scale 0) and it fits an i64: what printing and parsing it would give,
/// without either (most fields filters compare are such). None otherwise (a fraction, a large or
/// long-format value): print and parse it then.
///
/// # Safety
/// `n` points at a numeric (any varlena header) alive in memory.
unsafe fn small_integer(n: pg_sys::Numeric) -> Option<i64> {
    // numeric.c: a short-format header is 0b10 (short), a sign bit, 6 bits of display scale, and
    // a 7-bit weight (sign and 6 bits), in base-10000 digits (int16) after it. Numerics stored in
    // a jsonb keep the header they came with, so the varlena's may be short and its data
    // unaligned: read byte by byte.
    const SHORT: u16 = 0x8000;
    const FORMAT_MASK: u16 = 0xC000;
    const NEGATIVE: u16 = 0x2000;
    const DSCALE_MASK: u16 = 0x1F80;
    const WEIGHT_NEGATIVE: u16 = 0x0040;
    const WEIGHT_MASK: u16 = 0x003F;
    // SAFETY: `n` is a varlena (the caller's promise); its data holds `len` bytes.
    let (data, len) = unsafe {
        let varlena = n.cast::<pg_sys::varlena>();
        (
            pgrx::varlena::vardata_any(varlena).cast::<u8>(),
            pgrx::varlena::varsize_any_exhdr(varlena),
        )
    };
    // SAFETY: `i` is within the `len` bytes of the numeric's data.
    let word = |i: usize| unsafe { u16::from_ne_bytes([*data.add(i), *data.add(i + 1)]) };
    if len < 2 {
        return None;
    }
    let header = word(0);
    if header & FORMAT_MASK != SHORT || header & DSCALE_MASK != 0 {
        return None;
    }
    let weight = (header & WEIGHT_MASK) as i32 - if header & WEIGHT_NEGATIVE != 0 { 64 } else { 0 };
    let digits = (len - 2) / 2;
    if digits == 0 {
        return Some(0);
    }
    // Trailing zero digits are not stored: digits past the last are zeros.
    if weight < 0 || digits as i32 > weight + 1 {
        return None;
    }
    let mut value: i64 = 0;
    for i in 0..=weight as usize {
        let digit = if i < digits {
            word(2 + 2 * i) as i16
        } else {
            0
        };
        if !(0..10000).contains(&digit) {
            return None;
        }
        value = value.checked_mul(10000)?.checked_add(digit as i64)?;
    }
    if header & NEGATIVE != 0 {
        value = value.checked_neg()?;
    }
    Some(value)
}

/// A jsonb container printed (as jsonb_out prints it) and parsed.
///
/// # Safety
/// `container` points at a jsonb container alive in memory.
unsafe fn container_json(
    container: *mut pg_sys::JsonbContainer,
    estimated_len: std::ffi::c_int,
) -> Result<serde_json::Value, String> {
    let text = pg_sys::JsonbToCString(std::ptr::null_mut(), container, estimated_len);
    parse(&std::ffi::CStr::from_ptr(text).to_string_lossy())
}

fn parse(text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| e.to_string())
}
