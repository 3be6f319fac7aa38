//! The roles a node takes. One type for the CLI (`--roles`), the node record every member
//! reads, and the actors that run them: a role spelled differently in one of those places
//! would be a node that others misread.

use std::fmt;
use std::str::FromStr;

/// A role a node takes. Its lowercase name is how the CLI, the record's JSON and metrics
/// labels spell it; a record naming a role this version does not know is refused whole
/// (with the name) rather than read as a node with fewer roles.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The OpenAI HTTP API in front of this node's router.
    Gateway,
    /// Picks a worker per request and forwards its tokens.
    Router,
    /// Prefills and decodes its own requests.
    Worker,
    /// Computes prompts for decode workers and streams them the KV.
    Prefill,
    /// Decodes; takes long prompts' KV from a prefill worker when the router says so.
    Decode,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Gateway,
        Role::Router,
        Role::Worker,
        Role::Prefill,
        Role::Decode,
    ];

    /// The roles a node runs as supervised actors, restarted when they crash: all but the
    /// gateway, which is the node's HTTP server itself.
    pub const SUPERVISED: [Role; 4] = [Role::Router, Role::Worker, Role::Prefill, Role::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Router => "router",
            Role::Worker => "worker",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// Runs an engine: worker, prefill or decode.
    pub fn runs_engine(self) -> bool {
        matches!(self, Role::Worker | Role::Prefill | Role::Decode)
    }

    /// Takes generate requests from routers: worker or decode.
    pub fn generates(self) -> bool {
        matches!(self, Role::Worker | Role::Decode)
    }

    /// `names` as a comma-separated list, for messages.
    pub fn list(roles: &[Role]) -> String {
        roles
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role's name (surrounding spaces allowed, as in `--roles "gateway, router"`).
impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Role, UnknownRole> {
        let s = s.trim();
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_string()))
    }
}

/// A name that is none of [`Role::ALL`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown role '{0}' ({list})", list = Role::list(&Role::ALL))]
pub struct UnknownRole(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_spelled_the_same_everywhere() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{}\"", r.as_str()));
            let v = <Role as clap::ValueEnum>::to_possible_value(&r).unwrap();
            assert_eq!(v.get_name(), r.as_str());
        }
        assert_eq!(" decode ".parse::<Role>(), Ok(Role::Decode));
        let e = "cook".parse::<Role>().unwrap_err();
        assert_eq!(e, UnknownRole("cook".into()));
        let e = e.to_string();
        assert!(e.contains("'cook'") && e.contains("prefill"), "{e}");
        let e = serde_json::from_str::<Role>("\"cook\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cook"), "{e}");
    }
}
