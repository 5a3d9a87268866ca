//! Event ids: UUID version 7, time-ordered, so ids sort roughly by raise time and index well
//! wherever users store them.

/// A fresh event id as 16 bytes (RFC 9562 v7, monotonic within this process).
pub fn new_event_id() -> [u8; 16] {
    uuid::Uuid::now_v7().into_bytes()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_v7_and_increase() {
        let a = uuid::Uuid::from_bytes(super::new_event_id());
        let b = uuid::Uuid::from_bytes(super::new_event_id());
        assert_eq!(a.get_version_num(), 7);
        assert!(a < b);
    }
}
