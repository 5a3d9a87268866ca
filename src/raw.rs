//! Raw jsonb and array arguments.
//!
//! pgrx's `JsonB` turns every value into a `serde_json::Value` (jsonb_out, parse, and back again on
//! the way out). `raise` only needs to know that a payload is an object and to hand the very same
//! datum to the INSERT, so these types keep the datum as Postgres gave it.

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
