#[allow(non_upper_case_globals)]
const redact_emails: ::flue_runtime::__private::flue_core::lifecycle::ThreadHook = {
    use ::flue_runtime::__private::flue_core as __flue;
    #[allow(dead_code)]
    async fn __flue_hook_body(
        _state: &ThreadState,
        _call: &ToolCall,
        result: ToolResult,
    ) -> ToolResult {
        result
    }
    {
        static DEFINITION: __flue::lifecycle::ThreadHookDefinition = __flue::lifecycle::ThreadHookDefinition {
            id: "redact_emails",
            handler: __flue::lifecycle::ThreadHookHandler::BeforeStoreToolResult(|
                __flue_arg0,
                __flue_arg1,
                __flue_arg2|
            {
                ::std::boxed::Box::pin(async move {
                    {
                        use __flue::lifecycle::{
                            ConvertibleHookReturn as _, DisplayErrorHookReturn as _,
                            OtherHookReturn as _, TextErrorHookReturn as _,
                        };
                        let __flue_returned = __flue::send_body(
                                __flue_hook_body(
                                    __flue::lifecycle::hook_parameter(__flue_arg0),
                                    __flue::lifecycle::hook_parameter(__flue_arg1),
                                    __flue::lifecycle::hook_parameter(__flue_arg2),
                                ),
                            )
                            .await;
                        let __flue_returned = (&&&__flue::tool::Returned(
                            &__flue_returned,
                        ))
                            .__flue_hook_return()
                            .adapt(__flue_returned);
                        __flue::lifecycle::hook_return::<
                            __flue::lifecycle::ToolResult,
                            _,
                        >(__flue_returned)
                    }
                })
            }),
        };
        __flue::lifecycle::ThreadHook::new(&DEFINITION)
    }
};
