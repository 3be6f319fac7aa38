//! Cluster membership for kvmesh.
//!
//! Every node publishes a [`NodeRecord`] (roles, addresses, model, device, capacity, version)
//! under `/kvmesh/<cluster>/nodes/<node_id>` and everyone who needs the membership subscribes to
//! a live view of it. Two implementations of [`Registry`]:
//!
//! * [`EtcdRegistry`]: records are JSON values in etcd attached to a lease (TTL a few seconds)
//!   that a background task keeps alive; after a lease loss (etcd unreachable for longer than the
//!   TTL, the lease revoked, etcd restarted without its data) the record is re-published under a
//!   new lease without restarting anything. Subscribers get a view kept up to date by one watch
//!   per registry that resumes after disconnects.
//! * [`EmbeddedRegistry`]: in-process, for `kvmesh serve` (every role in one process, no etcd).
//! * [`DirRegistry`]: files in a directory of one machine, for several processes there
//!   without etcd (`kvmesh node --registry-dir`).
//!
//! With the `testing` feature (tests and bench programs), `testing::Etcd` starts a
//! throw-away etcd server.

mod backoff;
mod dir;
mod embedded;
mod error;
mod etcd;
mod record;
mod registry;
mod role;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use async_trait::async_trait;
pub use backoff::Backoff;
pub use dir::DirRegistry;
pub use embedded::EmbeddedRegistry;
pub use error::DiscoveryError;
pub use etcd::EtcdRegistry;
pub use record::{
    check_model_name, node_key, nodes_prefix, Membership, ModelNameError, NodeRecord,
};
pub use registry::{Registration, Registry};
pub use role::Role;

/// The lease TTL, in seconds, that `kvmesh` uses unless told otherwise.
pub const DEFAULT_TTL_SECS: i64 = 3;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{test_record, validate_cluster, validate_record};

    #[test]
    fn types_are_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Registration>();
        check::<EtcdRegistry>();
        check::<EmbeddedRegistry>();
        check::<DiscoveryError>();
        check::<std::sync::Arc<dyn Registry>>();
        fn send<T: Send>() {}
        send::<testing::Etcd>();
    }

    #[test]
    fn keys() {
        assert_eq!(node_key("c1", "n1"), "/kvmesh/c1/nodes/n1");
        assert!(node_key("c1", "n1").starts_with(&nodes_prefix("c1")));
    }

    #[test]
    fn record_json_round_trip() {
        let r = test_record("c", "n");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<NodeRecord>(&json).unwrap(), r);
        assert!(r.has_role(Role::Worker) && !r.has_role(Role::Gateway));
    }

    #[test]
    fn validation() {
        assert!(validate_record(&test_record("c", "n"), "c").is_ok());
        assert!(validate_record(&test_record("c", ""), "c").is_err());
        assert!(validate_record(&test_record("c", "a/b"), "c").is_err());
        let e = validate_record(&test_record("other", "n"), "c").unwrap_err();
        assert!(e.to_string().contains("other"), "{e}");
        assert!(validate_cluster("").is_err() && validate_cluster("a/b").is_err());
    }

    #[test]
    fn model_names() {
        for ok in ["tiny", "Qwen/Qwen3-0.6B", " padded ", "modèle"] {
            assert_eq!(check_model_name(ok), Ok(()), "{ok:?}");
        }
        let why = |n: &str| check_model_name(n).unwrap_err().to_string();
        assert_eq!(check_model_name(""), Err(ModelNameError::Empty));
        assert_eq!(
            check_model_name("a\nb"),
            Err(ModelNameError::Control { code: 10, at: 1 })
        );
        assert_eq!(why(""), "must not be empty");
        assert_eq!(why(" \u{3000} "), "must not be only whitespace");
        assert_eq!(
            why("tiny\n"),
            "contains a control character (U+000A) at byte 4"
        );
        assert_eq!(
            why("é\tx"),
            "contains a control character (U+0009) at byte 2"
        );
        assert!(why("a\0b").contains("U+0000) at byte 1"));
        assert!(why("a\u{85}").contains("U+0085"));
        // Control characters are named even in a name that is otherwise blank.
        assert!(why(" \r\n").contains("U+000D) at byte 1"));
    }

    #[test]
    fn records_must_carry_a_servable_model_name() {
        let mut r = test_record("c", "w1");
        r.model = "bad\nname".into();
        let e = validate_record(&r, "c").unwrap_err().to_string();
        assert!(e.contains("w1") && e.contains("U+000A"), "{e}");
        r.model = String::new();
        let e = validate_record(&r, "c").unwrap_err().to_string();
        assert!(e.contains("w1") && e.contains("must not be empty"), "{e}");
        // A gateway started without a model publishes none.
        r.roles = vec![Role::Gateway, Role::Router];
        assert!(validate_record(&r, "c").is_ok());
        r.model = "\t".into();
        assert!(validate_record(&r, "c").is_err());
    }
}
