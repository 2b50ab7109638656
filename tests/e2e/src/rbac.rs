//! RBAC the tests grant: ServiceAccounts, and rules bound to a subject in a namespace or
//! cluster-wide, applied as an admin would.

use kube::Client;
use kube::api::{Api, DynamicObject};
use serde_json::{Value, json};

use crate::objects::{api, apply, resource};

/// ServiceAccount `name` in `ns`, as a binding's subject.
pub fn account_subject(ns: &str, name: &str) -> Value {
    json!({"kind": "ServiceAccount", "name": name, "namespace": ns})
}

/// Create ServiceAccount `name` in `ns`.
pub async fn service_account(client: &Client, ns: &str, name: &str) -> anyhow::Result<()> {
    let accounts = api(client, &resource("", "v1", "ServiceAccount"), ns);
    apply(
        &accounts,
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
    )
    .await?;
    Ok(())
}

/// Role `name` in `ns` with `rules`, bound there to `subject`.
pub async fn bind_role(
    client: &Client,
    ns: &str,
    name: &str,
    rules: Value,
    subject: Value,
) -> anyhow::Result<()> {
    let rbac = |kind| {
        api(
            client,
            &resource("rbac.authorization.k8s.io", "v1", kind),
            ns,
        )
    };
    bind(
        &rbac("Role"),
        &rbac("RoleBinding"),
        "Role",
        name,
        rules,
        subject,
    )
    .await
}

/// What the chart's metrics-reader ClusterRole grants (`get /metrics`), bound to
/// ServiceAccount `account` of `ns`.
pub async fn may_read_metrics(client: &Client, ns: &str, account: &str) -> anyhow::Result<()> {
    bind_cluster_role(
        client,
        &format!("{ns}-metrics-reader"),
        serde_json::json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]),
        account_subject(ns, account),
    )
    .await
}

/// ClusterRole `name` with `rules`, bound cluster-wide to `subject`.
pub async fn bind_cluster_role(
    client: &Client,
    name: &str,
    rules: Value,
    subject: Value,
) -> anyhow::Result<()> {
    let rbac = |kind| {
        Api::<DynamicObject>::all_with(
            client.clone(),
            &resource("rbac.authorization.k8s.io", "v1", kind),
        )
    };
    let (roles, bindings) = (rbac("ClusterRole"), rbac("ClusterRoleBinding"));
    bind(&roles, &bindings, "ClusterRole", name, rules, subject).await
}

async fn bind(
    roles: &Api<DynamicObject>,
    bindings: &Api<DynamicObject>,
    kind: &str,
    name: &str,
    rules: Value,
    subject: Value,
) -> anyhow::Result<()> {
    apply(
        roles,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind,
               "metadata": {"name": name}, "rules": rules}),
    )
    .await?;
    apply(
        bindings,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": format!("{kind}Binding"),
               "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
               "subjects": [subject]}),
    )
    .await?;
    Ok(())
}
