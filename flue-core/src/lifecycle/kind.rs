//! The 17 lifecycle hook kinds.

use std::fmt;

/// A lifecycle hook kind: 14 thread kinds and 3 user-scope kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookKind {
    /// After a thread is created, before its first turn (event).
    AfterThreadCreated,
    /// On the parent, after a subagent thread is created (event).
    AfterSubagentCreated,
    /// Rewrites the rendered system message before the history snapshot (transform).
    AfterSystemMessage,
    /// Projects the persisted-history snapshot once per model request (transform).
    FilterMessages,
    /// Adjusts the provider-format messages before dispatch; may block (transform).
    PrefilterLlmHistory,
    /// Before a message row is inserted (transform, pre-write).
    BeforeCreateMessage,
    /// After a message row is inserted (event).
    AfterCreateMessage,
    /// Before a message row is updated (transform, pre-write).
    BeforeUpdateMessage,
    /// After a message row is updated (event).
    AfterUpdateMessage,
    /// Before a tool result is stored (transform).
    BeforeStoreToolResult,
    /// After a successful tool call (transform; `None` keeps the result).
    AfterToolCallSuccess,
    /// After a failed tool call (transform; `None` keeps the result).
    AfterToolCallFailure,
    /// When a tool call starts streaming, before the tool runs (event).
    ToolCallStarted,
    /// After a tool call executed (event).
    ToolCallDone,
    /// A client connected to the user event stream (user scope).
    UserClientAttached,
    /// A client disconnected from the user event stream (user scope).
    UserClientDetached,
    /// A user value was set or deleted (user scope).
    UserValueChanged,
}

impl HookKind {
    /// Every kind, thread kinds first, in the reference's order.
    pub const ALL: [HookKind; 17] = [
        HookKind::AfterThreadCreated,
        HookKind::AfterSubagentCreated,
        HookKind::AfterSystemMessage,
        HookKind::FilterMessages,
        HookKind::PrefilterLlmHistory,
        HookKind::BeforeCreateMessage,
        HookKind::AfterCreateMessage,
        HookKind::BeforeUpdateMessage,
        HookKind::AfterUpdateMessage,
        HookKind::BeforeStoreToolResult,
        HookKind::AfterToolCallSuccess,
        HookKind::AfterToolCallFailure,
        HookKind::ToolCallStarted,
        HookKind::ToolCallDone,
        HookKind::UserClientAttached,
        HookKind::UserClientDetached,
        HookKind::UserValueChanged,
    ];

    /// The kind's snake-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AfterThreadCreated => "after_thread_created",
            Self::AfterSubagentCreated => "after_subagent_created",
            Self::AfterSystemMessage => "after_system_message",
            Self::FilterMessages => "filter_messages",
            Self::PrefilterLlmHistory => "prefilter_llm_history",
            Self::BeforeCreateMessage => "before_create_message",
            Self::AfterCreateMessage => "after_create_message",
            Self::BeforeUpdateMessage => "before_update_message",
            Self::AfterUpdateMessage => "after_update_message",
            Self::BeforeStoreToolResult => "before_store_tool_result",
            Self::AfterToolCallSuccess => "after_tool_call_success",
            Self::AfterToolCallFailure => "after_tool_call_failure",
            Self::ToolCallStarted => "tool_call_started",
            Self::ToolCallDone => "tool_call_done",
            Self::UserClientAttached => "user_client_attached",
            Self::UserClientDetached => "user_client_detached",
            Self::UserValueChanged => "user_value_changed",
        }
    }

    /// The kind named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == name)
    }

    /// Whether the kind runs in user scope (with a `UserState`).
    pub fn is_user_scope(self) -> bool {
        matches!(
            self,
            Self::UserClientAttached | Self::UserClientDetached | Self::UserValueChanged
        )
    }
}

impl fmt::Display for HookKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
